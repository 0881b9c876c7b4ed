"""Where does a decode step's GPU time go? Top kernels of the engine's step, by total CUDA time.

Runs the engine on the random-init Qwen2.5-0.5B shape (as bench/rollout.py), or on any shape of
bench/grpo_step_worker.py (`--shape`, e.g. the mixture of experts qwen3-30b-a3b-half), with CUDA graphs off,
so every kernel is visible to the profiler, fused kernels on or off, and prints the kernels that
take most of the GPU time per decode step. The prefill is taken out: a run of 1 new token (prefill
and first sample) is profiled too, and the per-step figures are (long run − that) ÷ (steps − 1).

    python bench/profile_decode.py --sequences 256 --steps 32
    python bench/profile_decode.py --shape qwen3-30b-a3b-half --sequences 4 --fused on
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.rollout import build_models  # noqa: E402
from cohort_grpo.rollout import Engine# noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams# noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--shape", default="0.5b",
                        help="0.5b (a Qwen2.5 shape beside transformers') or a shape of bench/grpo_step_worker.py's "
                             "SHAPES, built as cohort's own model")
    parser.add_argument("--fused", choices=("both", "on", "off"), default="both", help="the engine's fused kernels")
    args = parser.parse_args(argv)
    if args.shape == "0.5b":
        _, model = build_models("0.5b")
    else:
        from bench.grpo_step_worker import SHAPES, build_module

        model = build_module(SHAPES[args.shape], "cuda").requires_grad_(False).eval()
    prompts = torch.randint(0, model.config.vocab_size, (args.sequences, args.prompt_len)).tolist()
    for fused in {"both": (True, False), "on": (True,), "off": (False,)}[args.fused]:
        engine = Engine(model, max_batch_size=args.sequences, use_cuda_graph=False, compile_kernels=fused)
        engine.bucketed = True
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=args.steps, eos_token_ids=[], seed=0))  # warm-up
        long, short = (kernel_times(engine, prompts, n) for n in (args.steps, 1))
        decode_steps = args.steps - 1
        per_step = {}
        for key, (us, calls) in long.items():
            prefill_us, prefill_calls = short.get(key, (0.0, 0))
            per_step[key] = ((us - prefill_us) / decode_steps, (calls - prefill_calls) / decode_steps)
        total_ms = sum(t for t, _ in per_step.values()) / 1000
        print(f"\n== fused kernels {'on' if fused else 'off'}: {args.sequences} sequences; "
              f"kernel time {total_ms:.3f} ms per decode step ==")
        for key, (us, calls) in sorted(per_step.items(), key=lambda kv: kv[1][0], reverse=True)[: args.top]:
            print(f"{us / 1000:8.4f} ms/step  {calls:6.1f} calls/step  {key[:110]}")
        engine.release()


def kernel_times(engine, prompts, new_tokens: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (GPU µs, launches)} of one generate() call. Only CUDA kernels are counted, not
    the aten ops that launch them, so nothing is counted twice."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, eos_token_ids=[], seed=0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, 1, params)
        torch.cuda.synchronize()
    return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0}


if __name__ == "__main__":
    main()
