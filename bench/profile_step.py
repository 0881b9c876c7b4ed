"""Where a GRPO step's GPU time goes: torch.profiler over one steady-state step of cohort.

Builds bench/grpo_step.py's random-init Qwen2.5 shape (in memory) and its 32 prompts × 8 generations,
512-token configuration, runs `--warmup` steps, then profiles one more and prints, per phase
(sampling, logprobs, update), its wall time and the CUDA kernels that take the most time, and the
update's FLOPs against its seconds. Diagnosis for issue 5, not a benchmark of record.

    python bench/profile_step.py --model 0.5b --options torch_compile=true
    python bench/profile_step.py --smoke          # CPU, tiny shape: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import _options  # noqa: E402
from grpo_step_worker import diagnosis_setup, make_prompts, make_reward, unsaved_trainer  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="0.5b")
    parser.add_argument("--options", default="", help="GRPOConfig fields, e.g. torch_compile=true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--host-top", type=int, default=0,
                        help="also print the update phase's top host (CPU) ops by self time: where a host-bound phase goes")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    from cohort_grpo import GRPOConfig
    from cohort_grpo.telemetry.metrics import rollout_attention_pairs, update_flops

    setup = diagnosis_setup(args.model, args.smoke)
    device, tokenizer, model = setup.device, setup.tokenizer, setup.model
    prompts, gens, completion = setup.prompts, setup.generations, setup.completion_len
    options = dict(per_device_train_batch_size=prompts, gradient_accumulation_steps=gens, num_generations=gens,
                   max_prompt_length=128, max_completion_length=completion, beta=0.04, learning_rate=1e-6,
                   loss_type="dapo", gradient_checkpointing=True, max_steps=args.warmup, eval_steps=0,
                   save_steps=0, log_completions_steps=10**6, output_dir="/tmp/profile-step", device=device,
                   overwrite_output_dir=True, quiet=True, seed=0)
    options.update(_options(args.options))
    prompt_rows = make_prompts(setup.shape["vocab_size"], prompts * 8, setup.prompt_len)
    trainer = unsaved_trainer()(model, [make_reward(completion)], prompt_rows, args=GRPOConfig(**options),
                                processing_class=tokenizer)
    trainer.train()  # the warm-up steps; the profiled one is run by hand below
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    phases = {}
    original = trainer.report.phase

    def timed_phase(name):  # a profiler range per phase, so kernels are attributed to it
        class Ranged:
            def __enter__(self):
                self.range = torch.profiler.record_function(f"phase::{name}")
                self.range.__enter__()
                self.inner = original(name)
                self.inner.__enter__()
                self.started = time.perf_counter()

            def __exit__(self, *exc):
                self.inner.__exit__(*exc)
                phases[name] = time.perf_counter() - self.started
                self.range.__exit__(*exc)
        return Ranged()

    trainer.report.phase = timed_phase
    step = trainer.step + 1
    with torch.profiler.profile(activities=activities) as prof:
        trainer.step = step
        trainer.memory.ref_offload.prefetch()  # as train() does at the top of a step: π_ref's copy overlaps sampling
        rows = trainer.next_prompts()
        with trainer.report.phase("sampling"):  # each of these times its own phase
            batch = trainer.sample(rows)
        trainer.score(batch)
        batch.old_logp, batch.ref_logp = trainer.reference_logprobs(batch)
        batch.advantages = trainer.estimate_advantages(batch)
        stats = trainer.update(batch)
    print(json.dumps({"phases_s": {k: round(v, 3) for k, v in phases.items()}, "micro_batches": stats.get("micro_batches")}))
    prompt_tokens = trainer.layout.computed_prompt_tokens(batch.prompt_ids, trainer.memory.micro_rows)
    completion_tokens = int(batch.rollout.completion_mask.sum())
    lengths = [int(n) for n in batch.rollout.completion_mask.sum(dim=1).tolist()]
    pairs = rollout_attention_pairs(trainer.model, trainer.layout, batch.prompt_ids, lengths, trainer.memory.micro_rows)
    flops = update_flops(trainer.model, prompt_tokens, completion_tokens, pairs)  # what the step log's MFU counts
    if "update" in phases:
        print(f"update: {prompt_tokens + completion_tokens} tokens, model FLOPs = {flops / 1e12:.1f} TFLOP in "
              f"{phases['update']:.2f} s = {flops / phases['update'] / 1e12:.0f} TFLOP/s")
    if device == "cuda":
        print_phase_kernels(prof, args.top)
    if args.host_top:
        print_phase_host_ops(prof, "update", args.host_top)
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[: args.top]
    total = sum(getattr(e, key, 0) for e in events)
    print(f"top {args.top} ops by self {('CUDA' if device == 'cuda' else 'CPU')} time (all phases, total {total / 1e3:.0f} ms):")
    for e in rows:
        print(f"  {getattr(e, key, 0) / 1e3:9.1f} ms  {e.count:7d}×  {e.key[:110]}")
    if device == "cuda":
        print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


def print_phase_kernels(prof, top: int) -> None:
    """Per phase: GPU-busy time (kernels that start inside the phase) against its wall time, and its top kernels.

    A phase whose kernels cover much less than its wall time is bound by the host (launches, syncs)."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    events = prof.events()
    windows = {e.name.split("::", 1)[1]: (e.time_range.start, e.time_range.end)
               for e in events if e.name.startswith("phase::") and e.device_type == DeviceType.CPU}
    # The phases' own ranges also appear on the device timeline: not kernels.
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("phase::")]
    for name, (start, end) in windows.items():
        inside = [k for k in kernels if start <= k.time_range.start < end]
        busy = sum(k.time_range.elapsed_us() for k in inside)
        by_name = defaultdict(lambda: [0.0, 0])
        for k in inside:
            by_name[k.name][0] += k.time_range.elapsed_us()
            by_name[k.name][1] += 1
        print(f"phase {name}: wall {(end - start) / 1e3:.0f} ms, GPU busy {busy / 1e3:.0f} ms "
              f"({100 * busy / max(end - start, 1):.0f}%), {len(inside)} kernels")
        for kname, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"    {us / 1e3:8.1f} ms {count:6d}x  {kname[:100]}")


def print_phase_host_ops(prof, phase: str, top: int) -> None:
    """The host ops inside `phase` with the most self CPU time (the profiler's own overhead inflates
    them all, so the ranking, not the absolute figure, is what to read)."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    events = prof.events()
    window = next(((e.time_range.start, e.time_range.end) for e in events
                   if e.name == f"phase::{phase}" and e.device_type == DeviceType.CPU), None)
    if window is None:
        return
    by_name = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.device_type == DeviceType.CPU and window[0] <= e.time_range.start < window[1] and not e.name.startswith("phase::"):
            by_name[e.name][0] += e.self_cpu_time_total
            by_name[e.name][1] += 1
    total = sum(us for us, _ in by_name.values())
    print(f"phase {phase}: host self time {total / 1e3:.0f} ms in {sum(c for _, c in by_name.values())} ops; top {top}:")
    for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {us / 1e3:8.1f} ms {count:6d}x  {name[:100]}")


if __name__ == "__main__":
    main()
