"""Several GPUs (issue 6): GRPO throughput at 1, 2 and 4 GPUs with one global batch, then FSDP2 on a 7B shape.

Part 1, data parallel (DDP): a random-init Qwen2.5-0.5B-shaped model (bf16 weights, fp32 masters)
trains on the same global batch — 128 prompts × 8 generations, 128-token prompts, 512-token
completions (random weights never emit EOS, so every completion is 512 tokens), β = 0.04 — on 1, 2
and 4 GPUs, each a `torchrun` job of its own. Throughput = completion tokens of the whole batch ÷
wall-clock seconds per step, steady state (mean of the steps after the first, which captures the
CUDA graphs). The ratios to 1 GPU are printed beside issue 6's targets (≥ 1.8× at 2, ≥ 3.4× at 4).
The engine keeps its default of 256 sequences decoded at once: one GPU samples the 1024 completions
in 4 waves of 256, four GPUs in one wave each (the same decode width per GPU at every count).
Part 2, FSDP2: a random-init Qwen2.5-7B-shaped model (fp32 masters sharded over 4 GPUs, bf16
compute, the engine sampling a full bf16 copy gathered once per step) trains a few steps with short
completions; step times and the peak memory of the busiest GPU are printed.

Prompts, tokenizer and reward are bench/grpo_step_worker.py's (the synthetic word-level vocabulary
of ../shared/bench/trl_baseline.py). Each rank builds the same random weights on its own GPU.

    python bench/multi_gpu.py                 # the device run: one call on a 4-GPU machine (~6 min)
    python bench/multi_gpu.py --smoke         # tiny shapes, CPU processes with gloo: checks the script

Writes $OUT/multi_gpu.json after every part (a run cut short keeps what it measured).
--time-budget skips the parts that no longer fit, saying so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=True)
COMMON = dict(max_position_embeddings=32768, rope_theta=1e6)
# Global batches: the same at every GPU count; per_device × accumulation × GPUs = prompts × generations.
SCALING = dict(prompts=128, generations=8, prompt_len=128, completion_len=512, per_device=32, steps=3, beta=0.04)
FSDP = dict(prompts=16, generations=4, prompt_len=64, completion_len=128, per_device=8, steps=4, beta=0.0)
SMOKE_SCALING = dict(prompts=8, generations=4, prompt_len=16, completion_len=16, per_device=4, steps=3, beta=0.04)
SMOKE_FSDP = dict(prompts=4, generations=4, prompt_len=16, completion_len=16, per_device=4, steps=3, beta=0.0)
TARGETS = {2: 1.8, 4: 3.4}  # issue 6: throughput at N GPUs ≥ target × 1 GPU
START_SECONDS = 45  # a part is started only with at least this much of the budget left


# ---- the worker: one rank of one torchrun job -----------------------------------------------------

def make_tokenizer(vocab: int):
    """Word 't<i>' is token i (whitespace-split); EOS t{V-1}, pad t{V-2}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"t{vocab - 1}", pad_token=f"t{vocab - 2}",
                                   unk_token="t0")


def build_model(shape: dict, device):
    """cohort's own CausalLM, random init (seed 0), built directly on `device`: bf16 on CUDA, fp32 on CPU."""
    import torch

    from cohort_grpo.models import CausalLM, ModelConfig

    vocab = shape["vocab_size"]
    config = ModelConfig.from_hf_dict({"model_type": "qwen2", **shape, **COMMON, "eos_token_id": vocab - 1,
                                       "pad_token_id": vocab - 2})
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with device:
            return CausalLM(config)
    finally:
        torch.set_default_dtype(default)


def worker(spec_path: str) -> None:
    import random

    import torch

    from cohort_grpo import GRPOConfig
    from grpo_step_worker import unsaved_trainer

    spec = json.loads(Path(spec_path).read_text())
    run, world = spec["run"], int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    completions = run["prompts"] * run["generations"]
    accumulation, rest = divmod(completions, run["per_device"] * world)
    if rest or accumulation < 1:
        raise SystemExit(f"{completions} completions do not split into {world} ranks × {run['per_device']}")
    vocab = spec["shape"]["vocab_size"]
    rng = random.Random(0)
    rows = [{"prompt": " ".join(f"t{rng.randrange(vocab - 2)}" for _ in range(run["prompt_len"]))}
            for _ in range(run["prompts"] * run["steps"])]

    def distinct_words(completions, **_):
        return [len(set(c.split())) / float(run["completion_len"]) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="cohort-multi-gpu-"), num_generations=run["generations"],
        per_device_train_batch_size=run["per_device"], gradient_accumulation_steps=accumulation,
        max_prompt_length=run["prompt_len"], max_completion_length=run["completion_len"], beta=run["beta"],
        learning_rate=1e-6, max_steps=run["steps"], fsdp=spec["fsdp"], device=spec["device"], seed=0,
        gradient_checkpointing=spec["fsdp"], log_completions_steps=10**6, report_to="none", quiet=True)
    stamps: list[float] = []

    class BenchTrainer(unsaved_trainer()):
        """A wall-clock stamp after every step."""

        def log_step(self, batch, losses, seconds):
            super().log_step(batch, losses, seconds)
            stamps.append(time.perf_counter())

    started = time.perf_counter()
    trainer = BenchTrainer(model=build_model(spec["shape"], device), reward_funcs=[distinct_words],
                           train_dataset=rows, args=config, processing_class=make_tokenizer(vocab))
    setup = time.perf_counter() - started
    trainer.train()
    if rank != 0:
        return
    history = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for r in trainer.history]
    first = history[0]["step_time"]  # FSDP2's gather of the new weights is inside the step
    step_seconds = [first] + [b - a for a, b in zip(stamps, stamps[1:])]
    tokens = [r["completions/mean_length"] * completions for r in history]
    warmup = min(run.get("warmup_steps", 1), len(step_seconds) - 1)  # steps that still capture graphs
    steady = step_seconds[warmup:]
    result = dict(gpus=world, fsdp=spec["fsdp"], setup_seconds=round(setup, 1), step_seconds=step_seconds,
                  steady_step_seconds=sum(steady) / len(steady), warmup_steps=warmup,
                  tokens_per_second=sum(tokens[warmup:]) / sum(steady),
                  peak_memory_gib=max(r.get("peak_memory_gib", 0.0) for r in history),
                  parameters=sum(p.numel() for p in trainer.model.parameters()),
                  accumulation=accumulation, history=history)
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name()
    Path(spec["result"]).write_text(json.dumps(result, indent=1))


# ---- the driver -----------------------------------------------------------------------------------

def launch(label: str, gpus: int, shape: dict, run: dict, fsdp: bool, device: str, scratch: Path,
           timeout: float) -> dict:
    """One torchrun job; its rank 0's result, or {"status": why not}."""
    spec = dict(shape=shape, run=run, fsdp=fsdp, device=device, result=str(scratch / f"{label}.json"))
    (scratch / f"{label}.spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
               str(HERE), "--worker", str(scratch / f"{label}.spec.json")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    print(f"== {label}: {gpus} {'GPU' if device == 'cuda' else 'CPU process'}(es), {'FSDP2' if fsdp else 'DDP'}",
          flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(status=f"stopped after {timeout:.0f} s (time budget)")
    if done.returncode != 0 or not Path(spec["result"]).is_file():
        return dict(status=f"failed (exit code {done.returncode})")
    result = json.loads(Path(spec["result"]).read_text())
    result.update(status="ok", wall_seconds=round(time.perf_counter() - started, 1))
    print(f"   {gpus}: {result['tokens_per_second']:,.0f} completion tok/s, {result['steady_step_seconds']:.2f} s/step "
          f"(steps {', '.join(f'{s:.2f}' for s in result['step_seconds'])} s), peak {result['peak_memory_gib']:.1f} GiB",
          flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU processes with gloo")
    parser.add_argument("--gpus", default=None, help="GPU counts of the scaling runs (default 1,2,4; smoke 1,2)")
    parser.add_argument("--fsdp-gpus", type=int, default=None, help="GPUs of the FSDP2 run (default 4; smoke 2)")
    parser.add_argument("--skip-fsdp", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="steps of each scaling run (default 3)")
    parser.add_argument("--warmup-steps", type=int, default=1,
                        help="first steps left out of the steady state (graph captures of new widths happen there)")
    parser.add_argument("--time-budget", type=float, default=540, help="seconds for all parts together")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    import torch

    device = "cpu" if args.smoke else "cuda"
    counts = [int(n) for n in (args.gpus or ("1,2" if args.smoke else "1,2,4")).split(",")]
    fsdp_gpus = args.fsdp_gpus or (2 if args.smoke else 4)
    available = os.cpu_count() if args.smoke else torch.cuda.device_count()
    if max(counts + [fsdp_gpus]) > available:
        print(f"this machine has {available} {'CPUs' if args.smoke else 'GPUs'}; --gpus / --fsdp-gpus ask for more")
        return 2
    scaling, fsdp_run = (SMOKE_SCALING, SMOKE_FSDP) if args.smoke else (SCALING, FSDP)
    scaling = dict(scaling, steps=args.steps or scaling["steps"], warmup_steps=args.warmup_steps)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, smoke=args.smoke,
                  device=torch.cuda.get_device_name() if device == "cuda" else "cpu (gloo)",
                  scaling_config=scaling, fsdp_config=fsdp_run, scaling={}, fsdp=None, skipped=[])
    started, scratch = time.perf_counter(), Path(tempfile.mkdtemp(prefix="multi-gpu-"))

    def save() -> None:
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "multi_gpu.json").write_text(json.dumps(report, indent=1))

    def left() -> float:
        return args.time_budget - (time.perf_counter() - started)

    print(f"{report['device']}, torch {report['torch']}, {report['date']}", flush=True)
    for gpus in counts:
        if left() < START_SECONDS:
            report["skipped"].append(f"scaling run on {gpus} GPUs: {left():.0f} s of budget left")
            continue
        report["scaling"][gpus] = launch(f"scaling-{gpus}", gpus, TINY if args.smoke else QWEN_05B, scaling, False,
                                         device, scratch, left())
        save()
    base = report["scaling"].get(counts[0], {}).get("tokens_per_second") if counts[0] == 1 else None
    for gpus, result in report["scaling"].items():
        if base and result.get("tokens_per_second") and gpus != 1:
            result["speedup"] = result["tokens_per_second"] / base
            target = TARGETS.get(gpus)
            verdict = "" if target is None else f" (issue 6 target ≥ {target}×: {'met' if result['speedup'] >= target else 'NOT met'})"
            print(f"scaling: {gpus} GPU(s) = {result['speedup']:.2f}× one GPU{verdict}", flush=True)
    save()
    if args.skip_fsdp:
        report["skipped"].append("FSDP2 run: --skip-fsdp")
    elif left() < START_SECONDS:
        report["skipped"].append(f"FSDP2 run: {left():.0f} s of budget left")
    else:
        report["fsdp"] = launch(f"fsdp-{fsdp_gpus}", fsdp_gpus, TINY if args.smoke else QWEN_7B, fsdp_run, True,
                                device, scratch, left())
    save()
    for line in report["skipped"]:
        print(f"skipped: {line}")
    ok = all(r.get("status") == "ok" for r in report["scaling"].values()) and (
        report["fsdp"] is None or report["fsdp"].get("status") == "ok")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
