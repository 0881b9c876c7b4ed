"""Where does a decode step's GPU time go? Top kernels of the engine's step, by total CUDA time.

Runs the engine on the random-init Qwen2.5-0.5B shape (as bench/rollout.py) with CUDA graphs off,
so every kernel is visible to the profiler, fused kernels on or off, and prints the kernels that
take most of the GPU time per decode step, plus the step's total kernel time against its wall time
(the gap is launch overhead, which the CUDA graph removes).

    python bench/profile_decode.py --sequences 256 --steps 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout import build_models  # noqa: E402
from cohort.engine import Engine  # noqa: E402
from cohort.rollout import SamplingParams  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    _, model = build_models("0.5b")
    prompts = torch.randint(0, model.config.vocab_size, (args.sequences, args.prompt_len)).tolist()
    for fused in (True, False):
        engine = Engine(model, max_batch_size=args.sequences, use_cuda_graph=False, compile_step=fused)
        engine.bucketed = True
        params = SamplingParams(max_new_tokens=args.steps, temperature=1.0, eos_token_ids=[], seed=0)
        engine.generate(prompts, 1, params)  # warm-up (and compilation)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, 1, params)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        kernel_us = sum(e.self_device_time_total for e in events)
        print(f"\n== fused kernels {'on' if fused else 'off'}: {args.sequences} sequences, {args.steps} steps; "
              f"kernel time {kernel_us / args.steps / 1000:.3f} ms per step ==")
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        for e in events[: args.top]:
            print(f"{e.self_device_time_total / args.steps / 1000:8.4f} ms/step  {e.count / args.steps:6.1f} calls/step  "
                  f"{e.key[:110]}")
        engine.release()


if __name__ == "__main__":
    main()
