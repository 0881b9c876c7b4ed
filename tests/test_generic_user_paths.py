"""A user's paths through the generic path (cohort_grpo/models/generic.py): a transformers model of a type cohort
does not implement, given as a folder or as a loaded object, through the options a user combines with it. Tiny
random models of transformers' own classes (test_generic_models.py), float32, CPU."""

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.models.generic import TransformersCausalLM
from cohort_grpo.models.tiny import build_tokenizer
from cohort_grpo.rollout import engine_samples
from cohort_grpo.run.policy import load_policy
from tests.test_generic_models import reference_model

pytestmark = pytest.mark.cpu("float32 CPU forwards of tiny models")


def test_model_impl_cohort_samples_a_loaded_model_object_in_the_engine():
    """model_impl=cohort with a loaded transformers model of another type wraps it for the engine (the user's
    module, its parameters shared) rather than leaving it to generate; auto keeps the object as given; a PEFT
    model object under cohort is refused in one line naming the option."""
    from peft import LoraConfig, get_peft_model

    reference, lines = reference_model("olmo2"), []
    model, _ = load_policy(reference, build_tokenizer(), impl="cohort", log=lines.append)
    assert isinstance(model, TransformersCausalLM) and engine_samples(model)
    assert model.transformers_model is reference and "generic path" in lines[0]
    plain, _ = load_policy(reference_model("olmo2"), build_tokenizer(), impl="auto")
    assert type(plain).__name__ == "Olmo2ForCausalLM"
    peft_model = get_peft_model(reference_model("olmo2"), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(CohortError, match="model_impl=cohort"):
        load_policy(peft_model, build_tokenizer(), impl="cohort")
