"""A TRL-style vision-language GRPO script on a CPU: a tiny random Qwen2.5-VL, Qwen3.5 (dense, MoE), Gemma 3, Idefics3,
SmolVLM or LLaVA and its processor, a dataset with an `image` column and conversational prompts holding an image part,
a reward that reads another column, and `from cohort_grpo import GRPOConfig, GRPOTrainer` as the script would import TRL's."""

import copy

import numpy as np
import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny_vision import RECURRENT_FAMILIES, build_vision_model, build_vision_processor
from cohort_grpo.models.vision_language import VisionLanguageModel
from cohort_grpo.rollout.images import load_image, row_images, with_image_parts
from cohort_grpo.run.policy import load_policy
from test_vision_language import processor_or_skip

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
VISION_PREFIXES = {"qwen2_5_vl": ("model.visual.",), "gemma3": ("model.vision_tower.", "model.multi_modal_projector."),
                   "idefics3": ("model.vision_model.", "model.connector."),
                   "smolvlm": ("model.vision_model.", "model.connector."),
                   "llava": ("model.vision_tower.", "model.multi_modal_projector."),
                   "qwen3_5": ("model.visual.",), "qwen3_5_moe": ("model.visual.",),
                   "qwen3_vl_moe": ("model.visual.",),
                   "llava_next": ("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline"),
                   "llava_onevision": ("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline")}
# Where it keeps its language tower's (Idefics3's and SmolVLM's under another name).
LANGUAGE_TOWERS = {family: "language_model" for family in VISION_PREFIXES} | {"idefics3": "text_model",
                                                                               "smolvlm": "text_model"}


def train(tmp_path, family: str = "qwen2_5_vl", **options):
    processor = processor_or_skip(family)
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
    """Two steps in the shared-prompt layout (the default, as for text; Qwen3.5's recurrent language tower: one padded
    row per completion): the sampler's log-probs are the update's (the same images in both), the rewards read the
    answer column, the language tower's weights move and the vision tower's (and its projector's) do not
    (freeze_vision_tower's default)."""
    trainer, initial = train(tmp_path, family)
    assert len(trainer.history) == 2
    # each prompt once in the log-prob passes and the update, its images with it
    assert trainer.layout.shared == (family not in RECURRENT_FAMILIES)
    for record in trainer.history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4
        assert "rewards/reward_answer/mean" in record
    assert trainer.history[1]["kl"] > 0
    assert changed(trainer, initial, f"model.{LANGUAGE_TOWERS[family]}.")
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
    assert adapted and all(f".{LANGUAGE_TOWERS[family]}." in name for name in adapted)
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


REWARD_MODULE = '''
def digit_share(prompts, completions, completion_ids=None, **_):
    texts = [c[0]["content"] for c in completions]  # conversational: one assistant message each
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) + 0.01 * len(t) for t in texts]
'''


@pytest.mark.slow
def test_fsdp_on_two_ranks_equals_one_process(tmp_path):
    """`--nproc_per_node 2` (gloo, CPU) with `--fsdp` trains the tiny Qwen2.5-VL (`--task shapes`) two steps with one
    process's loss, reward and gradient norm at every step and its final weights (float32), with the vision tower
    frozen (the default) and trained: FSDP2's units are the language tower's decoder layers, the vision tower is
    sharded with the root's weights."""
    import json
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    (tmp_path / "rewardmod.py").write_text(REWARD_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()]), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", CI="1")
    options = ["--task", "shapes", "--reward_funcs", "rewardmod:digit_share", "--num_generations", "2",
               "--per_device_train_batch_size", "4", "--max_completion_length", "6", "--max_prompt_length", "128",
               "--eval_limit", "0", "--learning_rate", "1e-3", "--beta", "0.04", "--num_iterations", "2", "--seed", "3",
               "--logging_steps", "1", "--device", "cpu", "--quiet", "--max_steps", "2"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

    def run(name, start, extra):
        done = subprocess.run([*start, "-m", "cohort_grpo", "train", *options, *extra, "--output_dir",
                               str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (name, done.stdout[-2000:], done.stderr[-3000:])
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return ([record for record in map(json.loads, lines) if "loss" in record],
                load_file(tmp_path / name / "model.safetensors"))

    final = {}
    for frozen in ("true", "false"):
        expected, final[frozen] = run(f"one-{frozen}", [sys.executable],
                                      ["--gradient_accumulation_steps", "4", "--freeze_vision_tower", frozen])
        got, saved = run(f"fsdp-{frozen}", launch,
                         ["--gradient_accumulation_steps", "2", "--fsdp", "--freeze_vision_tower", frozen])
        assert [record["step"] for record in got] == [1, 2]
        for mine, theirs in zip(got, expected):
            assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 and abs(mine["reward"] - theirs["reward"]) <= 1e-5
            assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= 1e-4 * max(1.0, theirs["grad_norm"])
        assert saved.keys() == final[frozen].keys()
        assert max(float((saved[k] - final[frozen][k]).abs().max()) for k in saved) <= 5e-5, frozen
    # the trained tower moved (the saved folder names its weights visual.*): they differ from the frozen run's
    assert any(not torch.equal(final["true"][k], final["false"][k]) for k in final["true"]
               if k.startswith("visual."))
