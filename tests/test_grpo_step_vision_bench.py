"""bench/grpo_step.py's vision-language shape (bench/grpo_step_vision.py): the Qwen2.5-VL-3B shape has the published
model's parameter count and a 448 × 448 image is 256 image tokens, and the smoke shape's build and cohort run go
through on a CPU (the TRL run needs trl, absent here: the driver skips it)."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench"))

pytestmark = pytest.mark.cpu("the smoke shape on a CPU")


def test_the_3b_shape_is_qwen2_5_vl_3b_and_its_image_is_256_tokens():
    """Built on the meta device (no memory): Qwen2.5-VL-3B-Instruct's 3,754,622,976 parameters (its safetensors'
    count, the tied embedding once), 669M of them the vision tower and merger."""
    import transformers

    vision = importlib.import_module("grpo_step_vision")
    from grpo_step_worker import SHAPES

    shape = SHAPES["qwen2.5-vl-3b"]
    config = vision.hf_config(shape)
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 3_754_622_976
    assert 0.66e9 < sum(p.numel() for p in model.model.visual.parameters()) < 0.68e9
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert vision.image_tokens(shape) == 256
    processor = vision.make_processor(shape)
    rows = vision.make_rows(shape, 2, 128)
    encoded = processor(text=[processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rows[0]["prompt"][0]["content"]}]}],
        tokenize=False)], images=[rows[0]["image"]], return_tensors="pt")
    ids = encoded["input_ids"][0].tolist()
    assert ids.count(config.image_token_id) == 256 and len(ids) == 128 + 256 + 2
    assert encoded["image_grid_thw"].tolist() == [[1, 32, 32]]


def test_smoke_shape_builds_and_trains_with_cohort(tmp_path):
    from grpo_step_worker import SMOKE

    run = dict(prompts=4, generations=4, prompt_len=16, completion_len=16, per_device=4, grad_accum=4, steps=2, rows=32)
    results = {}
    for kind in ("build", "cohort"):
        spec = dict(kind=kind, label=kind, shape=SMOKE["qwen2.5-vl-3b"], run=run, device="cpu", folder=str(tmp_path / "m"),
                    source="folder", gradient_checkpointing=None, micro_batch_tokens=None, cohort_options={})
        (tmp_path / f"{kind}.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "grpo_step_worker.py"), str(tmp_path / f"{kind}.json"),
                        str(tmp_path / f"{kind}.out.json")], cwd=REPO_ROOT, check=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
        results[kind] = json.loads((tmp_path / f"{kind}.out.json").read_text())
    assert results["build"]["status"] == "ok" and results["build"]["image_tokens"] == 4
    cohort = results["cohort"]
    assert cohort["status"] == "ok", cohort.get("error")
    assert cohort["prompt_tokens"] == 16 + 4 + 2 and len(cohort["step_seconds"]) == 2
    assert max(cohort["sampling_logp_difference_max"]) < 1e-4  # the images went into sampling and the update alike
    assert cohort["trainable"] == cohort["parameters"] == results["build"]["parameters"]  # the vision tower too, as TRL


def test_unfinished_flags_name_the_vision_shape_as_given():
    from types import SimpleNamespace

    from grpo_step_report import unfinished_flags

    results = {"comparisons": {"qwen2.5-vl-3b": {"model": "qwen2.5-vl-3b", "trl": {"status": "timeout"}},
                               "qwen2.5-0.5b": {"trl": {"status": "ok"}}}}
    args = SimpleNamespace(models=["qwen2.5-vl-3b", "0.5b", "1.5b"], lora_7b=False, max_full_param=[])
    assert unfinished_flags(results, args) == "--models qwen2.5-vl-3b,1.5b"
