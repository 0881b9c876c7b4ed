"""TRL 1.16's side of bench/scale.py: its GRPOTrainer under `accelerate launch` on the same GPUs with FSDP2
(transformers' `fsdp` and `fsdp_config`), its own `generate`, the same prompts, G, β, learning rate and reward.
`trl_run` launches it; each rank runs this file with the run's spec, and rank 0 writes the result."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

TRL_MICRO_BATCH = 4


# ---- TRL: GRPOTrainer under accelerate launch, FSDP2 ------------------------------------------------

def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def trl_run(args, shape: str, out: Path) -> dict:
    if not trl_available():
        return dict(skipped="TRL not installed")
    spec = out / f"trl-{shape}.json"
    result = out / f"trl-{shape}-result.json"
    spec.write_text(json.dumps(dict(shape=shape, smoke=args.smoke, gpus=args.gpus, steps=args.trl_steps,
                                    prompts=args.prompts_per_gpu * args.gpus, generations=args.num_generations,
                                    prompt_len=args.prompt_len, completion_len=args.cap, result=str(result))))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.gpus),
               "--num_machines", "1", "--mixed_precision", "no" if args.smoke else "bf16",
               *(["--cpu"] if args.smoke else []), str(Path(__file__).resolve()), str(spec)]
    try:
        done = subprocess.run(command, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=args.trl_timeout_s)
    except subprocess.TimeoutExpired:
        return timed_out(args, result.with_suffix(".progress.json"))
    if not result.is_file():
        return dict(error=f"TRL exited {done.returncode} without a result")
    return json.loads(result.read_text())


def steady_mean(values: list[float]) -> float:
    """The mean of `values` after the first (TRL's first step warms up), or of the one there is; 0 if none."""
    kept = values[1:] or values
    return sum(kept) / max(1, len(kept))


def timed_out(args, progress: Path) -> dict:
    """TRL ran past --trl_timeout_s: the steps it finished, or, where it finished none, a bound: the step it was in
    had already taken `seconds`, so TRL's tokens/s/GPU is at most a full-length batch's tokens over that time
    (a random model never samples EOS, so its completions reach the cap)."""
    state = json.loads(progress.read_text()) if progress.is_file() else {}
    walls = state.get("step_walls") or []
    tokens = args.prompts_per_gpu * args.gpus * args.num_generations * (args.prompt_len + args.cap)
    if walls:
        wall = steady_mean(walls)
        return dict(step_walls=walls, wall_s=wall, tok_per_s_per_gpu=tokens / (wall * args.gpus),
                    note=f"ran past --trl_timeout_s {args.trl_timeout_s:g} after {len(walls)} steps; tokens at the cap")
    began = state.get("step_began")
    if began is None:
        return dict(error=f"TRL ran past --trl_timeout_s {args.trl_timeout_s:g} before its first step began")
    seconds = time.time() - began
    return dict(bound=True, wall_s=seconds, tok_per_s_per_gpu=tokens / (seconds * args.gpus),
                note=f"its first step had not ended after {seconds:.0f} s (--trl_timeout_s {args.trl_timeout_s:g}): "
                     "tok/s/GPU is at most this")


def trl_worker(spec_path: str) -> None:
    """One rank of TRL's run; rank 0 writes the result (per-step wall times, tokens/s/GPU, the busiest GPU's peak)."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from grpo_step_worker import BETA, LEARNING_RATE, SHAPES, SMOKE, make_prompts, make_reward, make_tokenizer
    from grpo_step_worker import run_build
    from transformers import TrainerCallback
    import trl
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    shape = (SMOKE if spec["smoke"] else SHAPES)[spec["shape"]]
    cuda = not spec["smoke"]
    rank = int(os.environ.get("RANK", "0"))
    folder = Path(spec_path).with_suffix("") / "model"
    marker = folder / "built"  # after the weights: config.json is written before them
    if rank == 0 and not marker.is_file():
        run_build(dict(shape=shape, folder=str(folder), device="cuda" if cuda else "cpu"),
                  type("Silent", (), {"save": lambda self, **kw: None})())
        marker.touch()
    while not marker.is_file():  # the other ranks wait for rank 0's folder
        time.sleep(1)
    walls, lengths = [], []
    progress = Path(spec["result"]).with_suffix(".progress.json")

    def record(**state):  # rank 0's steps so far: what trl_run reads if the run outlasts its timeout
        if rank == 0:
            progress.write_text(json.dumps(dict(step_walls=[round(w, 2) for w in walls], **state)))

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.started = time.perf_counter()
            record(step_began=time.time())

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - self.started)
            record()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    per_gpu = spec["prompts"] * spec["generations"] // spec["gpus"]
    # TRL generates a whole optimizer step's completions at once (steps_per_generation = the accumulation) and
    # trains them TRL_MICRO_BATCH at a time: 64 rows of 4K tokens in one forward would hold 130 GB of logits.
    micro = min(per_gpu, TRL_MICRO_BATCH)
    layer = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer",
             "qwen3_moe": "Qwen3MoeDecoderLayer"}
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-scale-"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_gpu // micro, num_generations=spec["generations"],
        max_completion_length=spec["completion_len"], beta=BETA, learning_rate=LEARNING_RATE, bf16=cuda,
        logging_steps=1, max_steps=spec["steps"], report_to=[], save_strategy="no", gradient_checkpointing=True,
        temperature=1.0, top_k=0, top_p=1.0, disable_tqdm=True, use_cpu=not cuda,
        fsdp="full_shard auto_wrap",
        fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                     "transformer_layer_cls_to_wrap": [layer[shape["model_type"]]]})
    rows = make_prompts(shape["vocab_size"], spec["prompts"] * (spec["steps"] + 1), spec["prompt_len"])
    trainer = GRPOTrainer(model=str(folder), reward_funcs=[make_reward(spec["completion_len"])], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=make_tokenizer(shape["vocab_size"]),
                          callbacks=[Clock()])
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peaks = [None] * dist.get_world_size() if dist.is_initialized() else [peak]
    if dist.is_initialized():
        dist.all_gather_object(peaks, peak)
    if rank != 0:
        return
    wall, mean_length = steady_mean(walls), steady_mean(lengths)
    tokens = spec["prompts"] * spec["generations"] * (spec["prompt_len"] + mean_length)
    Path(spec["result"]).write_text(json.dumps(dict(
        trl=trl.__version__, step_walls=[round(w, 2) for w in walls], wall_s=wall, mean_completion_length=mean_length,
        tok_per_s_per_gpu=tokens / (wall * spec["gpus"]), peak_gib=max(p for p in peaks if p is not None)
        if cuda else None)))


if __name__ == "__main__":
    trl_worker(sys.argv[1])
