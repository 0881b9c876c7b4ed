"""A user's paths through the generic path (cohort_grpo/models/generic.py): a transformers model of a type cohort
does not implement, given as a folder or as a loaded object, through the options a user combines with it. Tiny
random models of transformers' own classes (test_generic_models.py), float32, CPU."""

import pytest
import torch

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


def test_what_only_cohorts_own_models_take_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """A folder of a type cohort does not implement, with an option only cohort's own models take
    (rollout_numerics=exact, torch_compile=true: it compiles their decoder layers), is refused in one line naming
    the option before any weights load; with model_impl hf torch_compile=true is refused by the config alone, and a
    loaded transformers model with it after loading."""
    from cohort_grpo import GRPOConfig
    from cohort_grpo.run import policy
    from tests.test_generic_models import save_folder

    folder = save_folder("olmo2", tmp_path / "olmo2")

    def args(**options):
        return GRPOConfig(output_dir=str(tmp_path / "run"), **options)

    def no_loading(*_, **__):
        raise AssertionError("the weights were loaded")

    for options, named in [(dict(rollout_numerics="exact"), "rollout_numerics=exact"),
                           (dict(torch_compile=True), "torch_compile=true")]:
        with monkeypatch.context() as patch:
            patch.setattr(policy, "load_policy", no_loading)
            with pytest.raises(CohortError, match=named) as refused:
                policy.load_run_policy(folder, None, args(**options), torch.device("cpu"))
        assert "olmo2 runs through transformers' modules" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(CohortError, match="torch_compile=true"):
        args(torch_compile=True, model_impl="hf").validate()
    with pytest.raises(CohortError, match="torch_compile=true"):
        policy.load_run_policy(reference_model("olmo2"), build_tokenizer(), args(torch_compile=True),
                               torch.device("cpu"))
    model, _, _ = policy.load_run_policy(folder, None, args(torch_compile="auto"), torch.device("cpu"))
    assert isinstance(model, TransformersCausalLM)


def test_a_vision_folder_with_model_impl_hf_is_refused_before_its_weights_load(tmp_path):
    """transformers' generate does not take the images: a vision-language folder with model_impl hf is refused in
    one line naming the option, from its config.json, before the weights load."""
    from cohort_grpo.models.tiny_vision import build_vision_model, build_vision_processor
    from cohort_grpo.run import policy

    processor = build_vision_processor()
    build_vision_model(processor.tokenizer).save_pretrained(tmp_path / "vl")
    processor.save_pretrained(tmp_path / "vl")

    (tmp_path / "vl" / "model.safetensors").write_bytes(b"not weights: loading them fails otherwise")
    with pytest.raises(CohortError, match="qwen2_5_vl with model_impl=hf") as refused:
        policy.load_policy(str(tmp_path / "vl"), impl="hf")
    assert "\n" not in str(refused.value)


def test_a_saved_lora_adapter_folder_given_as_the_model_names_what_to_pass(tmp_path):
    """A LoRA run saves its merged policy and, in adapter/, the adapters alone (peft's format). That adapter/
    folder given as the model is refused in one line that says it is an adapter and names the run's folder of
    merged weights; an adapter folder elsewhere names its base model."""
    import json
    import shutil

    from cohort_grpo import GRPOConfig
    from cohort_grpo.models.lora import apply_lora, lora_config_from_args
    from cohort_grpo.models.policy import save_policy

    model = TransformersCausalLM.wrap(reference_model("olmo2"))
    apply_lora(model, lora_config_from_args(GRPOConfig(use_peft=True, lora_r=2)))
    run = save_policy(model, build_tokenizer(), tmp_path / "run")
    with pytest.raises(CohortError, match="LoRA adapter") as refused:
        load_policy(str(run / "adapter"))
    assert f"pass {run}" in str(refused.value) and "\n" not in str(refused.value)
    alone = shutil.copytree(run / "adapter", tmp_path / "alone")
    config = json.loads((alone / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/models/olmo2-base"
    (alone / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(CohortError, match="LoRA adapter") as refused:
        load_policy(str(alone))
    assert "/models/olmo2-base" in str(refused.value) and "\n" not in str(refused.value)


def test_resuming_a_lora_run_without_its_adapters_names_use_peft(tmp_path):
    """A checkpoint of a LoRA run resumed without --use_peft (or a full run resumed with it, or with another rank)
    is the same model with other adapters: one line naming use_peft (lora_r), not "saved from another model"."""
    from cohort_grpo import GRPOConfig, GRPOTrainer
    from tests.test_generic_models import save_folder

    folder = save_folder("olmo2", tmp_path / "olmo2")
    rows = [{"prompt": f"{a}+{a}="} for a in range(4)]

    def trainer(out, **options):
        args = GRPOConfig(output_dir=str(out), **{"max_steps": 2, **options}, num_generations=2, per_device_train_batch_size=4,
                          max_completion_length=4, device="cpu", save_steps=1, report_to="none", quiet=True)
        return GRPOTrainer(folder, reward_funcs=[lambda completions, **_: [float(len(c)) for c in completions]],
                           train_dataset=rows, args=args, log=lambda *_: None)

    trainer(tmp_path / "lora", use_peft=True, lora_r=2, max_steps=1).train()
    trainer(tmp_path / "full", max_steps=1).train()
    for run, options, named in [("lora", {}, "use_peft"), ("full", dict(use_peft=True, lora_r=2), "use_peft"),
                                ("lora", dict(use_peft=True, lora_r=4), "lora_r")]:
        with pytest.raises(CohortError, match=named) as refused:
            trainer(tmp_path / run, **options).train(resume_from_checkpoint=str(tmp_path / run / "checkpoint-1"))
        assert "another model" not in str(refused.value) and "\n" not in str(refused.value)


def test_lora_on_a_family_whose_projections_are_transformers_conv1d():
    """GPT-2's projections are transformers' Conv1D (a linear layer with its weight transposed), not nn.Linear:
    --use_peft puts the adapters on them, and the merged weights give the adapted model's logits."""
    import transformers

    from cohort_grpo import GRPOConfig
    from cohort_grpo.models.lora import apply_lora, lora_config_from_args, merged_state_dict

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=len(build_tokenizer()))
    torch.manual_seed(0)
    model = TransformersCausalLM.wrap(transformers.GPT2LMHeadModel(config)).eval()  # no dropout
    fresh = TransformersCausalLM.wrap(transformers.GPT2LMHeadModel(config)).eval()
    fresh.load_state_dict(model.state_dict())
    apply_lora(model, lora_config_from_args(GRPOConfig(use_peft=True, lora_r=2, lora_dropout=0.0)))
    adapted = {name.split(".")[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"c_attn", "c_fc", "c_proj"}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)  # B starts at zero: give the adapters an effect
        input_ids = torch.tensor([[5, 9, 13, 17, 21]])
        fresh.load_state_dict(merged_state_dict(model))
        assert (model(input_ids) - fresh(input_ids)).abs().max() < 1e-4


def test_disable_dropout_makes_the_updates_log_probs_those_of_the_no_grad_passes(tmp_path):
    """GPT-2's config keeps dropout (0.1 on the residuals, embeddings and attention): in train mode the update's
    logits are then a random draw unlike the eval-mode passes of π_old and π_ref, and the run says so in one line.
    TRL's disable_dropout turns every one off (LoRA's included), after which train-mode logits equal eval-mode's."""
    import transformers

    from cohort_grpo import GRPOConfig
    from cohort_grpo.models.dropout import active_dropouts
    from cohort_grpo.run.policy import load_run_policy

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=len(build_tokenizer()))
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    build_tokenizer().save_pretrained(tmp_path / "gpt2")
    input_ids = torch.tensor([[5, 9, 13, 17, 21]])
    for disable in (False, True):
        lines = []
        args = GRPOConfig(output_dir=str(tmp_path / "run"), disable_dropout=disable, use_peft=True, lora_r=2)
        model, _, _ = load_run_policy(str(tmp_path / "gpt2"), None, args, torch.device("cpu"), log=lines.append)
        said = [line for line in lines if line.startswith("dropout:")]
        assert len(said) == (0 if disable else 1) and (disable or "--disable_dropout true" in said[0])
        assert bool(active_dropouts(model)) != disable
        with torch.no_grad():
            evaluated = model.eval()(input_ids)
            torch.manual_seed(1)
            trained = model.train()(input_ids)
        assert torch.equal(trained, evaluated) == disable
