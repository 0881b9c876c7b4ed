"""Vision-language runs that stop and go on: a run resumed from its checkpoint ends where the uninterrupted one did
(the checkpoint's weights are written in the family's original names and read back into the model's own), and
asynchronous rollouts sample with the prompts' images — step 1 as the synchronous run samples it, a resumed run
bit for bit the uninterrupted one, its rollouts sampled ahead coming back with their images."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.models.tiny_vision import build_vision_model, build_vision_processor, family_unavailable
from cohort_grpo.tasks.shapes import ShapesTask

torch.set_num_threads(1)
TASK = ShapesTask()
ROWS = TASK.load("train", size=16)


def odd_length(completions, **kwargs):
    """A reward that varies within groups, so every step moves the weights."""
    return [float(len(str(c)) % 2) for c in completions]


def config(out, **overrides) -> GRPOConfig:
    base = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, max_prompt_length=128,
                max_steps=4, learning_rate=0.05, output_dir=str(out), quiet=True, seed=0, save_steps=1,
                save_total_limit=0, logging_steps=1, eval_limit=0, device="cpu")
    base.update(overrides)
    return GRPOConfig(**base)


def train(out, family: str | None = None, **overrides) -> GRPOTrainer:
    """A run of `cohort:tiny-vision` (a Qwen2.5-VL), or of a tiny random model of `family` (tiny_vision.py)."""
    model, processor = "cohort:tiny-vision", None
    if family is not None:
        processor = build_vision_processor(family=family)
        model = build_vision_model(processor.tokenizer, family=family)
    trainer = GRPOTrainer(model, odd_length, ROWS, args=config(out, **overrides), task=TASK, processing_class=processor,
                          log=lambda *_: None)
    trainer.train()
    return trainer


def records(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def completions(out, step: int) -> list:
    rows = map(json.loads, (out / "completions.jsonl").read_text().splitlines())
    return [r["completion"] for r in rows if r["step"] == step]


def resume_from(run, step: int, out, family: str | None = None, **overrides) -> dict:
    """A new folder holding `run`'s checkpoint of `step` alone, resumed to the end: its final weights."""
    out.mkdir()
    shutil.copytree(run / f"checkpoint-{step}", out / f"checkpoint-{step}")
    train(out, family, resume=True, **overrides)
    return load_file(out / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cpu("bitwise-equal runs: the CPU sums in a fixed order, a GPU's atomics do not")
@pytest.mark.slow
@pytest.mark.parametrize("async_rollouts", [False, True])
def test_a_resumed_vision_language_run_ends_where_the_uninterrupted_one_did(tmp_path, async_rollouts):
    options = dict(async_rollouts=async_rollouts, max_staleness=1) if async_rollouts else {}
    straight = tmp_path / "straight"
    train(straight, **options)
    final = load_file(straight / "model.safetensors")
    assert not same_weights(final, load_file(straight / "checkpoint-1" / "model.safetensors"))  # the weights moved
    assert same_weights(resume_from(straight, 2, tmp_path / "resumed", **options), final)
    assert [r["loss"] for r in records(tmp_path / "resumed")][-2:] == [r["loss"] for r in records(straight)][-2:]
    if async_rollouts:
        assert [r["async/staleness"] for r in records(straight)] == [0.0, 1.0, 1.0, 1.0]
        synchronous = tmp_path / "synchronous"
        train(synchronous, max_steps=1)  # the same prompts, images and policy: the producer samples what it does
        assert completions(straight, 1) == completions(synchronous, 1) and completions(straight, 1)


@pytest.mark.cpu("bitwise-equal runs: the CPU sums in a fixed order, a GPU's atomics do not")
@pytest.mark.slow
def test_a_resumed_qwen3_5_moe_run_ends_where_the_uninterrupted_one_did(tmp_path):
    """Qwen3.5-MoE (a hybrid language tower, one padded row per completion): its checkpoint holds the experts as
    transformers writes them, one matrix per expert, in the family's original names; resumed at step 2, the run
    ends with the uninterrupted run's weights and last loss."""
    if family_unavailable("qwen3_5_moe"):
        pytest.skip(family_unavailable("qwen3_5_moe"))
    straight = tmp_path / "straight"
    train(straight, "qwen3_5_moe", max_steps=3)
    final = load_file(straight / "model.safetensors")
    assert not same_weights(final, load_file(straight / "checkpoint-1" / "model.safetensors"))
    assert same_weights(resume_from(straight, 2, tmp_path / "resumed", "qwen3_5_moe", max_steps=3), final)
    assert [r["loss"] for r in records(tmp_path / "resumed")][-1:] == [r["loss"] for r in records(straight)][-1:]


def test_rows_and_image_inputs_travel_as_plain_values_a_weights_only_load_takes(tmp_path):
    from PIL import Image

    from cohort_grpo.models.vision_language import ImageInputs
    from cohort_grpo.rollout.images import restored_images, restored_rows, stored_images, stored_rows

    rgb = Image.frombytes("RGB", (3, 2), bytes(range(18)))
    grey = Image.frombytes("L", (2, 2), bytes([0, 50, 100, 255]))
    palette = rgb.convert("P")
    rows = [{"prompt": "a", "image": rgb, "answer": 1}, {"prompt": "b", "images": [grey, palette], "answer": 2},
            {"prompt": "c", "image": "picture.png"}]
    shared = ImageInputs(torch.rand(4, 6), torch.tensor([[1, 2, 2]]))
    images = [shared, shared, None, ImageInputs(torch.rand(2, 6), None)]
    path = tmp_path / "state.pt"
    torch.save({"rows": stored_rows(rows), "images": stored_images(images)}, path)
    loaded = torch.load(path, weights_only=True)
    back = restored_rows(loaded["rows"])
    for before, after in [(rgb, back[0]["image"]), (grey, back[1]["images"][0]), (palette, back[1]["images"][1])]:
        assert after.mode == before.mode and after.size == before.size and after.tobytes() == before.tobytes()
    assert back[1]["images"][1].getpalette() == palette.getpalette()
    assert back[2] == rows[2] and back[0]["answer"] == 1
    inputs = restored_images(loaded["images"])
    assert inputs[0] is inputs[1] and inputs[2] is None  # a prompt's rows share one again: its images run once
    assert torch.equal(inputs[0].pixel_values, shared.pixel_values) and torch.equal(inputs[0].image_grid_thw,
                                                                                     shared.image_grid_thw)
    assert inputs[3].image_grid_thw is None and torch.equal(inputs[3].pixel_values, images[3].pixel_values)


def test_the_processors_other_image_tensors_travel_with_their_pixels(tmp_path):
    """A family's other image tensors (Idefics3's pixel_attention_mask, Mistral 3's image_sizes) come back with
    their pixels from a weights-only load, and `.to` moves them; a batch without them stores what it stored before."""
    from cohort_grpo.models.vision_language import ImageInputs
    from cohort_grpo.rollout.images import restored_images, stored_images

    tiles = ImageInputs.from_processor({"input_ids": torch.ones(1, 3), "pixel_values": torch.rand(1, 2, 3, 4, 4),
                                        "pixel_attention_mask": torch.ones(1, 2, 4, 4, dtype=torch.long)})
    sized = ImageInputs.from_processor({"pixel_values": torch.rand(2, 3, 4, 4), "image_sizes": torch.tensor([[4, 4],
                                                                                                           [2, 4]])})
    assert set(tiles.extra_tensors) == {"pixel_attention_mask"} and tiles.image_grid_thw is None
    assert set(stored_images([ImageInputs(torch.rand(2, 6))])) == {"pixel_values", "image_grid_thw", "of_row"}
    path = tmp_path / "state.pt"
    torch.save(stored_images([tiles, tiles, None, sized]), path)
    inputs = restored_images(torch.load(path, weights_only=True))
    assert inputs[0] is inputs[1] and inputs[2] is None
    for before, after in [(tiles, inputs[0]), (sized, inputs[3])]:
        assert torch.equal(after.pixel_values, before.pixel_values) and after.extra_tensors.keys() == \
            before.extra_tensors.keys()
        assert all(torch.equal(after.extra_tensors[name], tensor) for name, tensor in before.extra_tensors.items())
    moved = sized.to("meta")
    assert moved.extra_tensors["image_sizes"].device.type == "meta" and moved.pixel_values.device.type == "meta"
