"""8B-class GRPO on one node: tokens per second per GPU by NeMo-RL's formula, synchronous and asynchronous, against
TRL 1.16 in the same call on the same GPUs; Qwen3-30B-A3B (at half depth on 2 GPUs, whole on 4) with and without
routing replay; and `--plan`, the memory plan's capacity rows (nothing measured).

    python bench/scale.py --plan                       # CPU: what fits 8B on 2×80 GB, 14B on 2×H200, 32B and 30B-A3B on 4×H200
    python bench/scale.py --gpus 2                     # GPUs: llama3.1-8b and qwen3-8b, cohort sync + async, TRL
    python bench/scale.py --gpus 2 --models llama3.1-8b --frameworks cohort   # one shape, cohort only
    python bench/scale.py --gpus 2 --models qwen3-30b-a3b-half --frameworks cohort   # MoE: replay on and off
    python bench/scale.py --gpus 4 --models qwen3-30b-a3b --frameworks cohort --sync_options fsdp=true,free_sampling_memory=true,rollout_tensor_parallel_size=4
    python bench/scale.py --smoke                      # CPU: tiny shapes, 2 gloo processes, checks the plumbing

`--plan` prints, for each capacity row of the issue (4,096-token completions), the plan of cohort_grpo/memory/
training_plan.py for a ladder of configurations, each adding one change to the one before: cohort's defaults;
the engine as a tensor-parallel shard over the training ranks (the colocated placement); one completion a
micro-batch; the KV cache and the engine's weights freed for the update (`--free_sampling_memory`, which
under FSDP2 releases the engine's weights from each rollout to the refresh that rewrites them); then at most 32
sequences decoded at once (what `max_concurrent_sequences=auto` does by itself where the cache would not fit). The defaults already reduce-scatter FSDP2's gradients every micro-batch, keep
AdamW's moments in bf16 on the shard (`optimizer_state_dtype` auto on a GPU) and widen to fp32 after sharding. A row fits where its busiest
phase leaves `HEADROOM_GIB` of the card (the CUDA context, NCCL, the allocator).

`--gpus N` measures, for each shape (random weights, the synthetic tokenizer of bench/grpo_step_worker.py):
- cohort, synchronous (`--sync_options`, default FSDP2 over the N GPUs) and asynchronous (`--async_options`,
  default on 2 GPUs colocated under FSDP2, each GPU's engine sampling ahead while it trains; from 4 GPUs
  `--rollout_gpus N/2`, half the GPUs sample and half train: on 2 H200s one trainer GPU updating all of an 8B
  step took over 100 s a step, 2026-11-28), each mode one `torchrun` job of
  bench/async_rollouts.py's machinery (its `DrawnLengthEngine`: completion lengths drawn lognormal, median
  `--median`, 99th percentile at the cap, capped at 4,096; the engine decodes exactly the drawn tokens);
- TRL 1.16's GRPOTrainer under `accelerate launch` on the same N GPUs with FSDP2 (transformers' `fsdp` and
  `fsdp_config`), its own `generate`, the same prompts, G, β, learning rate and reward; `--trl_steps` steps
  (bench/scale_trl.py).

Per row: tokens/s/GPU = (prompt + completion tokens of a step) ÷ (step wall time × N), NeMo-RL's formula; the
busiest GPU's peak memory; `time/weight_sync` (sampling ranks receiving the weights; under FSDP2 the gather into
the engine's copy, `time/gather`) as a share of the step; cohort ÷ TRL.

A mixture of experts (`qwen3-30b-a3b-half`: Qwen3-30B-A3B with 24 of its 48 layers) runs each mode with routing
replay and without (`--routing_replay both|true|false`, the GRPOConfig field), partial rollouts off (they do not
keep a carried group's routes), and its asynchronous mode colocated under FSDP2 (`async_rollouts=true,fsdp=true`:
with N/2 sampling ranks one trainer GPU would hold the whole ~15B model's full-parameter state). Its rows add
`routing/replay_mismatch` (the share of tokens whose free top-k in the trainer differs from the sampler's in some
layer) and the full-shape equivalent: the measured figure × 0.5, since the half-depth shape does about half the
work a token, against NeMo-RL's full-shape 1,102 (synchronous) and 1,414 (asynchronous) tokens/s/GPU. Its
tensor-parallel engine splits every expert by its columns (`--sync_options ...,rollout_tensor_parallel_size=2`).

The batch, against NeMo-RL's Llama-3.1-8B row (16 H100s; its GRPO recipe as we read it: 64 prompts × 32
generations = 2,048 sequences a step, 128 a GPU, at most 4,096 tokens a sequence). Kept: G = 32, the 4,096-token
completion cap, the formula. Different: `--prompts_per_gpu` (default 2: 64 sequences a GPU, half NeMo-RL's, so
that the full-parameter state of an 8B model on 2 GPUs leaves room for the KV cache); 256-token random prompts
(the cap is on completions, so a sequence may reach 4,352 tokens); lengths drawn, not the model's own (a random
model never ends); random weights. TRL's completions always reach the cap (a random model never samples EOS,
and TRL's generate cannot stop at a drawn length), and its static batch pays the longest completion anyway, so
its figure is the most a long-tailed batch could give it.

Writes scale.json (and prints a markdown table) to --out (default $OUT, else runs/scale_bench). `--smoke` runs
the same code on the CPU with the tiny SMOKE twins, 2 processes over gloo, a few steps (the tiny MoE: sync with
replay, async without), and skips TRL where it is not installed ("TRL not installed").
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
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

HEADROOM_GIB = 2.0
CAPACITY_ROWS = (  # shape, GPUs, card, card GiB (the issue's capacities)
    ("llama3.1-8b", 2, "80 GB (H100)", 79.6),
    ("qwen2.5-14b", 2, "H200", 140.4),
    ("qwen2.5-32b", 4, "H200", 140.4),
    ("qwen3-30b-a3b-half", 2, "H200", 140.4),
    ("qwen3-30b-a3b", 4, "H200", 140.4),
)
# tokens/s/GPU, on-policy and one-step off-policy. Qwen3-30B-A3B's figures are the full shape's (32 H100s); the
# half-depth shape does about half the work per token, so its measured figure times `work_share` compares with them.
NEMO_RL = {"llama3.1-8b": dict(sync=1562, async_=2161),
           "qwen3-30b-a3b-half": dict(sync=1102, async_=1414, work_share=0.5),
           "qwen3-30b-a3b": dict(sync=1102, async_=1414)}
REPLAY_MISMATCH = "routing/replay_mismatch"


def ladder():
    """(label, changes to the step, changes to what a rank holds), each on top of the ones before."""
    return [
        ("cohort's defaults (engine a whole copy; 16 completions a micro-batch)", {}, {}),
        ("+ the engine a tensor-parallel shard over the GPUs (colocated)", {}, {"sampling_split": "ranks"}),
        ("+ one completion a micro-batch (--per_device_train_batch_size 1)", {"micro_rows": 1}, {}),
        ("+ KV cache and the engine's weights freed for the update (--free_sampling_memory true)",
         {"free_sampling_memory": True}, {"engine_in_update": False}),
        ("+ at most 32 sequences decoded at once (--max_concurrent_sequences 32)", {"engine_slots": 32}, {}),
    ]


def plan_rows(prompt_len: int = 256, completion_len: int = 4096, prompts_per_gpu: int = 2, group: int = 32) -> list:
    from grpo_step_worker import BETA, SHAPES, config_dict

    from cohort_grpo.plans.training_plan import GIB, RankShape, StepShape, training_memory_plan
    from cohort_grpo.models import ModelConfig

    rows = []
    for shape, gpus, card, card_gib in CAPACITY_ROWS:
        config = ModelConfig.from_hf_dict(config_dict(SHAPES[shape]))
        step = StepShape(rows=prompts_per_gpu * group, group=group, prompt_len=prompt_len,
                         completion_len=completion_len, micro_rows=16, reference=BETA > 0)  # π_ref, as the runs
        rank = RankShape(ranks=gpus, fsdp=True)
        entry = dict(shape=shape, gpus=gpus, card=card, card_gib=card_gib, completions_per_gpu=step.rows,
                     prompt_len=prompt_len, completion_len=completion_len, ladder=[], fits_from=None)
        for label, step_changes, rank_changes in ladder():
            step = replace(step, **step_changes)
            rank = replace(rank, **{k: gpus if v == "ranks" else v for k, v in rank_changes.items()})
            plan = training_memory_plan(config, step, rank)
            fits = plan.peak / GIB <= card_gib - HEADROOM_GIB
            entry["ladder"].append(dict(configuration=label, fits=fits, peak_gib=round(plan.peak / GIB, 1),
                                        busiest=plan.describe(terms=5), plan=plan.as_dict()))
            if fits and entry["fits_from"] is None:
                entry["fits_from"] = label
        rows.append(entry)
    return rows


def plan_table(rows: list) -> str:
    lines = []
    for row in rows:
        lines += [f"\n{row['shape']} on {row['gpus']}× {row['card']} ({row['card_gib']} GiB), "
                  f"{row['completions_per_gpu']} completions a GPU of {row['prompt_len']} + {row['completion_len']} "
                  f"tokens: fits from \"{row['fits_from'] or 'none of these'}\"", "",
                  "| configuration | peak GiB a GPU | fits | busiest phase (largest terms, GiB) |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {r['configuration']} | {r['peak_gib']} | {'yes' if r['fits'] else 'no'} | {r['busiest']} |"
                  for r in row["ladder"]]
    return "\n".join(lines)


# ---- cohort: bench/async_rollouts.py's machinery, one torchrun job a mode ----------------------------

def is_moe(shape: str) -> bool:
    from grpo_step_worker import SHAPES

    return bool(SHAPES[shape].get("num_experts"))


def cohort_runs(args, shape: str) -> list[tuple[str, str, list[str]]]:
    """(label, mode, GRPOConfig options) of each cohort run of `shape`. The asynchronous default samples colocated
    under FSDP2 on 2 GPUs, and on N/2 ranks of their own from 4; a mixture of experts' always colocated (one
    trainer GPU cannot hold a 15B model's full-parameter state, and sampling ranks need a trainer's whole
    weights), and runs each mode with and/or without routing replay (`--routing_replay`)."""
    moe = is_moe(shape)
    colocated = moe or args.gpus <= 2
    default = "async_rollouts=true,fsdp=true" if colocated else f"rollout_gpus={args.gpus // 2},async_rollouts=true"
    async_options = [o for o in (args.async_options or default).split(",") if o]
    if not any(o.startswith("async_rollouts=") for o in async_options):
        async_options.append("async_rollouts=true")
    runs = [(mode, mode, options) for mode, options in (("sync", args.sync_options), ("async", async_options))
            if mode in args.modes]
    if not moe:
        return runs
    replays = {"both": (True, False), "true": (True,), "false": (False,)}[args.routing_replay]
    runs = [(label if replay else f"{label}, no replay", mode, [*options, f"routing_replay={str(replay).lower()}"])
            for replay in replays for label, mode, options in runs]
    if args.smoke and len(runs) == 4:  # each code path once: sync with replay, async without
        runs = [runs[0], runs[3]]
    return runs


def cohort_modes(args, shape: str, out: Path) -> dict:
    import async_rollouts

    argv = ["--model", shape, "--processes", str(args.gpus), "--cap", str(args.cap), "--median", str(args.median),
            "--num_generations", str(args.num_generations), "--prompt_len", str(args.prompt_len),
            "--prompts", str(args.prompts_per_gpu * args.gpus), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--per_device", str(args.per_device), "--precapture", args.precapture, "--out", str(out)]
    if args.smoke:
        argv = ["--smoke", "--model", shape, "--processes", str(args.gpus), "--out", str(out), "--prompts",
                str(args.prompts_per_gpu * args.gpus)]
    if is_moe(shape):  # partial rollouts do not keep a carried group's routes: the same schedule with replay or not
        argv += ["--partial_rollouts", "false"]
    results = {}
    for label, mode, options in cohort_runs(args, shape):
        extra = ["--modes", mode]
        for option in options:
            key, _, value = option.partition("=")
            if key == "rollout_gpus":
                extra += ["--rollout_gpus", value]
            else:
                extra += ["--option", option]
        started = time.perf_counter()
        try:
            report = async_rollouts.main(argv + extra)
        except Exception as error:  # noqa: BLE001 - the other runs and TRL still run; the row says why
            if args.smoke:
                raise
            results[label] = dict(error=f"{type(error).__name__}: {error}"[:400])
            continue
        run = report["modes"].get(mode)
        if run is None:
            results[label] = dict(error=report.get("errors", {}).get(mode, "no result"))
            continue
        summary = run["summary"]
        measured = [s for s in run["steps"] if s["step"] > (1 if args.smoke else args.warmup)]
        weight_sync = mean_of(measured, "time/weight_sync", "time/gather")
        tok_per_gpu = summary.get("tok_per_s_per_gpu")
        work_share = NEMO_RL.get(shape, {}).get("work_share")
        results[label] = dict(tok_per_s_per_gpu=tok_per_gpu, wall_s=summary.get("wall_s"),
                              full_shape_tok_per_s_per_gpu=tok_per_gpu * work_share if tok_per_gpu and work_share
                              else None, peak_gib=summary.get("peak_memory_gib"), weight_sync_s=weight_sync,
                              weight_sync_share=weight_sync / summary["wall_s"] if weight_sync and summary.get("wall_s")
                              else None, tokens_per_step=summary.get("tokens_per_step"),
                              replay_mismatch=mean_of(measured, REPLAY_MISMATCH),
                              expert_load_max_over_mean=mean_of(measured, "routing/expert_load_max_over_mean"),
                              options=options, seconds=round(time.perf_counter() - started, 1))
    return results


def mean_of(steps: list[dict], *keys: str) -> float | None:
    """The mean over `steps` of the first of `keys` each step has; None where none has any."""
    values = [next((s[k] for k in keys if s.get(k) is not None), None) for s in steps]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="store_true", help="print the capacity rows of the memory plan and exit")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--models", default="llama3.1-8b,qwen3-8b")
    p.add_argument("--frameworks", default="cohort,trl")
    p.add_argument("--modes", default="sync,async", help="cohort's modes to run")
    p.add_argument("--precapture", default="on", choices=["on", "off"],
                   help="capture the engine's decode graphs before training (off: in the warm-up steps)")
    p.add_argument("--prompts_per_gpu", type=int, default=2)
    p.add_argument("--num_generations", type=int, default=32)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--cap", type=int, default=4096)
    p.add_argument("--median", type=float, default=1024)
    p.add_argument("--per_device", type=int, default=1, help="cohort's per_device_train_batch_size")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--trl_steps", type=int, default=2)
    p.add_argument("--trl_timeout_s", type=float, default=560)
    p.add_argument("--sync_options", default="fsdp=true,free_sampling_memory=true",
                   help="GRPOConfig fields of the synchronous mode, comma-separated KEY=VALUE")
    p.add_argument("--async_options", default=None,
                   help="of the asynchronous mode (rollout_gpus=K is the launcher's); default fsdp=true (colocated) "
                        "on 2 GPUs and for a mixture of experts, else rollout_gpus=N/2")
    p.add_argument("--routing_replay", default="both", choices=["both", "true", "false"],
                   help="mixture-of-experts shapes: each mode with routing replay, without, or both")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.gpus, args.prompts_per_gpu, args.trl_steps = 2, 2, 2
        args.num_generations, args.prompt_len, args.cap, args.steps, args.warmup = 4, 16, 48, 3, 1
        args.models = "llama3.1-8b,qwen3-30b-a3b-half"
    args.sync_options = [o for o in args.sync_options.split(",") if o]
    args.models = [m for m in args.models.split(",") if m]
    args.modes = [m for m in args.modes.split(",") if m]
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    return args


def markdown(rows: list, gpus: int) -> str:
    lines = ["| shape | run | tok/s/GPU (NeMo-RL's formula) | full-shape equivalent (× work share) | step wall s "
             "| peak GiB (busiest GPU) | weight sync share | replay mismatch | ÷ TRL |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    for row in rows:
        trl = row.get("trl", {})
        for name, r in [*row.get("cohort", {}).items(), *([("trl", trl)] if "trl" in row else [])]:
            if "error" in r or "skipped" in r:
                lines.append(f"| {row['shape']} | {name} | {r.get('error') or r.get('skipped')} | | | | | | |")
                continue
            ratio = (r["tok_per_s_per_gpu"] / trl["tok_per_s_per_gpu"]
                     if name != "trl" and r.get("tok_per_s_per_gpu") and trl.get("tok_per_s_per_gpu") else None)
            # TRL's step outlasting its timeout bounds its rate from above, so cohort's ratio from below
            at_most = "≤ " if name == "trl" and r.get("bound") else ""
            at_least = "≥ " if ratio and trl.get("bound") else ""
            lines.append(f"| {row['shape']} | {name} on {gpus} GPUs | {at_most}{fmt(r.get('tok_per_s_per_gpu'), ',.0f')} "
                         f"| {fmt(r.get('full_shape_tok_per_s_per_gpu'), ',.0f')} | {fmt(r.get('wall_s'), '.1f')} "
                         f"| {fmt(r.get('peak_gib'), '.1f')} | {fmt(r.get('weight_sync_share'), '.1%')} "
                         f"| {fmt(r.get('replay_mismatch'), '.1%')} | {at_least}{fmt(ratio, '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or (tempfile.mkdtemp(prefix="scale-") if args.smoke
                                                      else HERE.parent / "runs" / "scale_bench"))
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    command = "python " + " ".join([sys.argv[0]] + sys.argv[1:]) if argv is None else f"main({argv!r})"
    report: dict = dict(bench="scale", date=stamp, command=command)
    if args.plan:
        rows = plan_rows(args.prompt_len, args.cap, args.prompts_per_gpu, args.num_generations)
        report.update(kind="plan", headroom_gib=HEADROOM_GIB, rows=rows)
        print(plan_table(rows))
        (out / "scale_plan.json").write_text(json.dumps(report, indent=1) + "\n")
        return report
    import torch

    report.update(card=torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
                  gpus=args.gpus, workload=dict(prompts_per_gpu=args.prompts_per_gpu, G=args.num_generations,
                                                prompt_len=args.prompt_len, cap=args.cap, median=args.median,
                                                steps=args.steps, warmup=args.warmup),
                  nemo_rl=NEMO_RL, rows=[])
    for shape in args.models:
        row = dict(shape=shape)
        if "cohort" in args.frameworks:
            row["cohort"] = cohort_modes(args, shape, out / f"cohort-{shape}")
        if "trl" in args.frameworks:
            from scale_trl import trl_run

            try:
                row["trl"] = trl_run(args, shape, out)
            except subprocess.TimeoutExpired:
                row["trl"] = dict(error=f"TRL ran past --trl_timeout_s {args.trl_timeout_s:g}")
        report["rows"].append(row)
        (out / "scale.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = markdown(report["rows"], args.gpus)
    report["table"] = table
    print("\n" + table + "\n", flush=True)
    (out / "scale.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.smoke:
        for row in report["rows"]:
            for label, run in row["cohort"].items():
                assert run.get("tok_per_s_per_gpu"), (row["shape"], label, run)
                assert (run.get("replay_mismatch") is not None) == is_moe(row["shape"]), (row["shape"], label, run)
        print(f"smoke: OK — cohort {' and '.join(args.modes)} ran on 2 gloo processes, the mixture of experts with and without "
              "routing replay; TRL: "
              f"{report['rows'][0].get('trl', {}).get('skipped', 'ran')}", flush=True)
    return report


if __name__ == "__main__":
    main()
