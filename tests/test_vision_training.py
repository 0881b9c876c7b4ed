"""A TRL-style vision-language GRPO script on a CPU: a tiny random Qwen2.5-VL or Gemma 3 and its processor, a dataset
with an `image` column and conversational prompts holding an image part, a reward that reads another column, and
`from cohort_grpo import GRPOConfig, GRPOTrainer` as the script would import TRL's."""

import copy

import numpy as np
import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny_vision import build_vision_model, build_vision_processor
from cohort_grpo.models.vision_language import VisionLanguageModel
from cohort_grpo.rollout.images import load_image, row_images, with_image_parts
from cohort_grpo.run.policy import load_policy

pytestmark = pytest.mark.cpu("two training steps of a tiny vision-language model")


def image(seed: int, size=(56, 84)):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3)).astype("uint8"))


def dataset(count: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"count {i}: "}]}],
             "image": image(i), "answer": str(i)} for i in range(count)]


def reward_answer(completions, answer, **kwargs):
    """Reads the row's `answer` column, as TRL passes the other columns."""
    return [float(expected in completion[0]["content"]) for completion, expected in zip(completions, answer)]


def reward_length(completions, **kwargs):
    return [-len(completion[0]["content"]) / 10 for completion in completions]


# Where each family keeps the weights that turn pixels into image embeddings (frozen by default).
VISION_PREFIXES = {"qwen2_5_vl": ("model.visual.",), "gemma3": ("model.vision_tower.", "model.multi_modal_projector.")}


def train(tmp_path, family: str = "qwen2_5_vl", **options):
    processor = build_vision_processor(family=family)
    model = build_vision_model(processor.tokenizer, family=family)
    initial = copy.deepcopy(model.state_dict())
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=6, device="cpu", learning_rate=1e-3,
                      beta=0.04, report_to="none", **options)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_answer, reward_length], args=args,
                          train_dataset=dataset(), processing_class=processor)
    trainer.train()
    return trainer, initial


def changed(trainer, initial, prefix) -> set[str]:
    """The weights whose names start with `prefix` (a string or a tuple of them) that training moved."""
    state = trainer.model.transformers_model.state_dict()
    return {name for name, value in initial.items() if name.startswith(prefix) and not torch.equal(state[name], value)}


@pytest.mark.parametrize("family", sorted(VISION_PREFIXES))
def test_two_steps_train_the_language_tower_with_the_vision_tower_frozen(tmp_path, family):
    """Two steps: the sampler's log-probs are the update's (the same images in both), the rewards read the answer
    column, the language tower's weights move and the vision tower's (and its projector's) do not
    (freeze_vision_tower's default)."""
    trainer, initial = train(tmp_path, family)
    assert len(trainer.history) == 2
    for record in trainer.history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4
        assert "rewards/reward_answer/mean" in record
    assert trainer.history[1]["kl"] > 0
    assert changed(trainer, initial, "model.language_model.")
    assert not changed(trainer, initial, VISION_PREFIXES[family])
    # The saved folder (model, tokenizer, processor files) loads back as the vision-language policy it was.
    folder = tmp_path / "run"
    assert (folder / "processor_config.json").is_file()
    reloaded, _ = load_policy(str(folder), processing_class=build_vision_processor(family=family),
                              log=lambda line: None)
    assert isinstance(reloaded, VisionLanguageModel) and reloaded.model_type == family
    state = reloaded.transformers_model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in trainer.model.transformers_model.state_dict().items())


@pytest.mark.parametrize("family", sorted(VISION_PREFIXES))
def test_vision_tower_trains_when_asked_and_lora_adapts_the_language_tower_only(tmp_path, family):
    """freeze_vision_tower=False moves the vision tower's weights (and its projector's) too; with LoRA the adapters
    sit in the language tower's projections only (the vision tower's share their names)."""
    trainer, initial = train(tmp_path / "full", family, freeze_vision_tower=False)
    assert all(changed(trainer, initial, prefix) for prefix in VISION_PREFIXES[family])
    trainer, _ = train(tmp_path / "lora", family, use_peft=True, lora_r=4)
    adapted = [name for name, _ in trainer.model.named_parameters() if "lora_" in name]
    assert adapted and all(".language_model." in name for name in adapted)
    assert len(trainer.history) == 2


def test_images_as_data_holds_them():
    """An image column holds PIL images, paths, bytes or undecoded datasets values; a prompt without image parts
    gets them at the start of its first user turn; mismatches are one-line errors."""
    import io

    picture = image(0)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    loaded = load_image({"bytes": buffer.getvalue(), "path": None})
    assert np.array_equal(np.asarray(loaded), np.asarray(picture))
    assert len(row_images({"prompt": "p", "images": [picture, buffer.getvalue()]})) == 2
    assert row_images({"prompt": "p"}) is None
    assert with_image_parts("what is this?", 2) == [{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": "what is this?"}]}]
    with pytest.raises(CohortError, match="1 image parts for 2 images"):
        with_image_parts(dataset(1)[0]["prompt"], 2)
    with pytest.raises(CohortError, match="is not a file"):
        load_image("/no/such/image.png")


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


@pytest.mark.parametrize("options, trainer_options, refused", [
    (dict(async_rollouts=True), {}, "async_rollouts with a vision-language model is not supported yet"),
    (dict(rollout_numerics="exact"), {}, "rollout_numerics=exact needs cohort's own models"),
    ({}, dict(tools=[add]), "tool turns with images are not supported yet"),
])
def test_what_images_cannot_do_yet_is_refused_by_name(tmp_path, options, trainer_options, refused):
    processor = build_vision_processor()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=4, device="cpu", report_to="none", **options)
    with pytest.raises(CohortError, match=refused):
        GRPOTrainer(model=build_vision_model(processor.tokenizer), reward_funcs=[reward_length], args=args,
                    train_dataset=dataset(), processing_class=processor, **trainer_options)
