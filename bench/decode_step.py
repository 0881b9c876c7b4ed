"""Milliseconds per decode step of cohort's engine on a bench shape (random weights), whole on one GPU or split
T ways over T GPUs: where a tensor-parallel split's sampling time goes.

Each rank builds its part of the model directly on its GPU in bf16 (bench/grpo_step_worker.py's `build_module`:
a `TensorParallelCausalLM` shard under torchrun, else the whole `CausalLM`), then, for each batch size N, samples N random 256-token prompts twice, for
SHORT and SHORT + STEPS new tokens, after a warm-up call that captures the CUDA graphs. A decode step's time is the
difference over STEPS: prefill and the first token cancel out. Every sequence runs to the end (no EOS), so the
batch stays N wide. Printed per N: ms per decode step, tokens per second a GPU, and the shard's weight bytes
over the step time: the bandwidth the step would use if it read every weight once (a mixture of experts at a
useful batch touches nearly every expert in each layer).

    python bench/decode_step.py --shape qwen3-30b-a3b-half --sequences 64,128             # one GPU, T = 1
    torchrun --nproc_per_node 2 bench/decode_step.py --shape qwen3-30b-a3b-half --sequences 64,128,256   # T = 2
    python bench/decode_step.py --smoke                   # CPU: the shape's tiny twin (gloo under torchrun)

Both rows of one shape in one call: run the two commands on separate GPUs at the same time
(CUDA_VISIBLE_DEVICES). The JSON goes to $OUT/decode_step-T{T}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cohort from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step_worker import SHAPES, SMOKE, build_module  # noqa: E402

from cohort_grpo.rollout import Engine  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402

PROMPT_LEN = 256


def decode_step_seconds(engine: Engine, vocab: int, sequences: int, short: int, steps: int, repeats: int = 3) -> float:
    """Seconds a decode step takes at `sequences` wide: (run of short + steps tokens − run of short) ÷ steps, the
    median of `repeats` such differences."""
    generator = torch.Generator().manual_seed(sequences)
    prompts = torch.randint(0, vocab, (sequences, PROMPT_LEN), generator=generator).tolist()

    def run(new_tokens: int) -> float:
        params = SamplingParams(max_new_tokens=new_tokens, eos_token_ids=[], seed=0)
        synchronize(engine)
        started = time.perf_counter()
        engine.generate(prompts, 1, params)
        synchronize(engine)
        return time.perf_counter() - started

    run(short + steps)  # warm-up: CUDA graphs for every width this batch passes through
    # the median of `repeats` differences: one host hiccup (a GC pause, another process) moved a lone one by 30%
    return statistics.median((run(short + steps) - run(short)) / steps for _ in range(repeats))


def synchronize(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-half", help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("--sequences", default="64,128")
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="differences measured; their median is reported")
    parser.add_argument("--smoke", action="store_true", help="the shape's tiny twin on the CPU, a few steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu") if args.smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    if args.smoke:
        args.short, args.steps, args.sequences, args.repeats = 2, 4, "4,8", 1
    shape = (SMOKE if args.smoke else SHAPES)[args.shape]
    model = build_module(shape, device, dist.group.WORLD if world > 1 else None).requires_grad_(False).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for sequences in [int(n) for n in args.sequences.split(",") if n]:
        engine = Engine(model, max_batch_size=sequences)
        seconds = decode_step_seconds(engine, shape["vocab_size"], sequences, args.short, args.steps, args.repeats)
        rows.append(dict(sequences=sequences, ms_per_step=round(seconds * 1e3, 3),
                         tokens_per_s_per_gpu=round(sequences / seconds / world, 1),
                         weight_gb_per_s=round(weight_bytes / seconds / 1e9, 1)))
        del engine
    report = dict(shape=args.shape, tensor_parallel=world, card="cpu" if device.type == "cpu" else
                  torch.cuda.get_device_name(device), shard_weight_bytes=weight_bytes,
                  shard_weight_gib=round(weight_bytes / 2**30, 2),
                  prompt_len=PROMPT_LEN, short=args.short, steps=args.steps, rows=rows,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), torch=torch.__version__)
    if rank == 0:
        print(f"{args.shape}, T = {world} ({report['card']}): the shard holds {report['shard_weight_gib']} GiB of weights")
        print("| sequences | ms per decode step | tokens/s a GPU | weight bytes / step time (GB/s) |")
        print("| --- | --- | --- | --- |")
        for row in rows:
            print(f"| {row['sequences']} | {row['ms_per_step']} | {row['tokens_per_s_per_gpu']:,} | {row['weight_gb_per_s']} |")
        out = Path(args.out or os.environ.get("OUT") or ".")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"decode_step-T{world}.json").write_text(json.dumps(report, indent=2) + "\n")
    if world > 1:
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
