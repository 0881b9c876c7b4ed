"""Synchronous GRPO against asynchronous rollouts (`async_rollouts=True, max_staleness=L`), same global batch,
on R1-like completion lengths: throughput of the whole step, and what the stale samples cost.

Both modes run through `cohort_grpo.GRPOTrainer.train()` — the trainer's real loop — in one process, on the same
random-weight model (rebuilt from the same seed for each mode), the same prompts, the same sampling seeds and
the same per-completion length draws. A callback stamps the end of every step.

Workload (GPU defaults): a Qwen2.5-0.5B-shaped random model (`--model`: other Qwen2.5 sizes, and the
Llama-3.1-8B and Qwen3-8B shapes of NeMo-RL's dense rows) in bf16 (cohort's own `CausalLM`, the synthetic
word-level tokenizer of bench/grpo_step_worker.py), 32 prompts × G = 8 = 256 completions per step, 128-token
random prompts, β = 0.04, μ = 1, lr 1e-6, loss_type dapo, reward = fraction of distinct words (as
bench/grpo_step.py); gradient checkpointing on and at most 65,536 padded tokens per micro-batch (`--option`
changes any GRPOConfig field).

How completions end (the lengths). Each completion's stop length is drawn before it is sampled, from a
lognormal: median `--median` (1024) tokens, σ = `--sigma` (default ln(cap / median) / 2.326, so that the 99th
percentile sits at the cap: 0.894 for 1024 / 8192), capped at `--cap` = max_completion_length (8192) — the
long tail of R1-style outputs, so a step waits for its longest completion (with 256 draws, about 2.6 per step
reach the cap). Each completion's draw is keyed by (`--seed`, the rollout's sampling seed, its index in the step's batch),
and the trainer gives step t the same sampling seed in both modes, so step t draws the same lengths in both.
A random model never ends on its own (it samples EOS with probability ~1/151,936 per token), so the length is
imposed inside the engine, where a real EOS acts: `DrawnLengthEngine` is cohort's `Engine` with one override,
`_prefill`, which sets each new sequence's `Sequence.limit` to min(its drawn length, max_new_tokens) before the
sequence enters its KV-cache slot. The engine then really decodes that many tokens and no more: the sequence
finishes at its limit, its slot is retired and (continuous batching) refilled or compacted away, exactly what
a sampled EOS does. Every token the trainer trains on was sampled by the engine, with its recorded sampling
log-prob; none is appended or replaced (the completion has no EOS token at its end: the stop is the drawn
length). A completion that stopped at a drawn length below the cap is relabelled finish_reason "stop" (as an
EOS would leave it); one whose draw reached the cap keeps "length" (truncated, as a real overlong completion).
An EOS the model does sample first ends the completion earlier, as it would anyway (counted: `eos_stops`).
The engine is injected through the trainer's `sampler_factory` argument (a sampling rank's: `SamplingRank`'s),
which makes `DrawnLengthEngine`s (the trainer's sampler and, with async rollouts, the producer's); nothing in
cohort_grpo/ is edited.

Measured per step (the record of the trainer's `StepReport`, plus the callback's clock and the engine's calls):
- wall: seconds between the ends of consecutive steps (the steady-state period of the loop);
- completion tokens per second over the whole step: tokens sampled for the step ÷ its wall time;
- tokens per second per GPU by NeMo-RL's formula: every token of the step's sequences (prompts and
  completions) ÷ (wall × processes), the figure trainers are compared by;
- `time/weight_sync` with --rollout_gpus: the sampling rank's seconds receiving a new version's weights;
- step_time (the trainer's own), `time/sampling` (sync: the sampling itself; async: only the wait for the
  producer's rollout), `time/update`, `time/logprobs` (π_ref's pass), `time/rewards`;
- the producer's own sampling seconds (the engine call that made the step's rollout: in async mode it ran
  during earlier steps), decode steps, longest completion, CUDA-graph captures;
- async: `async/staleness` and the `sampling/*` metrics (|log π_θ − log π_sampler| mean / max, the truncated
  importance ratio min / mean / max). In bf16 on a GPU the sync mode logs them too (the sampler's kernels are
  not the trainer's), so the two columns separate kernel mismatch from staleness.
The first `--warmup` steps of each mode (compilation, allocator, the async pipeline filling) are left out of
the means.

One process (the default): the producer thread shares the one GPU (and its default CUDA stream) with the
update, so what overlaps is host work (Python, launch, the engine's host checks) with device work, and the
producer's decode with the trainer's phases only as far as one stream lets it; the trainer's phase clocks
synchronise the whole device, so on one GPU `time/*` of the async mode include some of the producer's kernels.

Several GPUs (`--processes N --rollout_gpus K`): each mode runs under torchrun on N processes, with the same
global batch. sync is DDP over all N (each rank samples and trains its share); async samples on K ranks of
their own (`--rollout_gpus`, cohort_grpo/parallel/disaggregation.py) and trains on the other N − K, the weights going to
the samplers after each update. Rank 0's records give the figures: tokens per step from the global mean
completion length (the engine columns stay empty: rank 0's engine sees only its share, or nothing).

CUDA graphs (`--precapture`, on by default on CUDA): before `train()`, each sampling engine captures its
decode graphs for every (width bucket, KV-length bucket) it can use, while nothing else runs. Otherwise the
producer would capture graphs lazily while the main thread launches and synchronises kernels, which torch's
default ("global") capture mode may refuse — the engine then decodes without graphs for good. Both modes
precapture, so neither pays captures inside its measured steps (the table counts any that happen).

`--curves`: both modes for `--curve_steps` (60) steps on the built-in arithmetic task, its default model
(the warm-started tiny model) and its default options (8-token completions), on the CPU, held-out greedy
accuracy every `--curve_eval_steps` (10) steps; writes async_rollouts_curves.json and, when matplotlib
imports, async_rollouts_curves.png (reward and held-out accuracy against the step).

    python bench/async_rollouts.py                 # GPU: both modes, 5 steps each (2 warm-up); ≈ 6-8 min on one H100 (estimated)
    python bench/async_rollouts.py --processes 4 --rollout_gpus 2   # 4 GPUs: DDP against 2 samplers + 2 trainers
                                   # (cohort's defaults there: partial rollouts, max_staleness 2; add
                                   # --partial_rollouts false --max_staleness 1 for the plain schedule)
    python bench/async_rollouts.py --curves_only   # CPU: the learning curves (≈ 1 min on 2 cores, estimated)
    python bench/async_rollouts.py --smoke         # CPU, tiny model, lengths median 8 / cap 48: checks the plumbing
    python bench/async_rollouts.py --smoke --curves   # ... and a 3-step run of the curves' code

Prints a markdown table and a JSON line (card, date, command); writes async_rollouts.json / .md (and the
curves' files) to --out (default: $OUT when set, else runs/async_rollouts_bench; a temporary folder with
--smoke). `python bench/async_rollouts_report.py async_rollouts.json --write-docs` puts
the figures on docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # cohort from this checkout, without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shapes, tokenizer and prompts of grpo_step_worker

from cohort_grpo.rollout.engine import Engine  # noqa: E402
from cohort_grpo.rollout.partial import partial_rollout_settings  # noqa: E402

SAMPLING_KEYS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max")
PHASES = ("time/sampling", "time/rewards", "time/logprobs", "time/update")
WEIGHT_SYNC = "time/weight_sync"  # a sampling rank's seconds receiving a version's weights (--rollout_gpus)
BETA, LEARNING_RATE, LOSS_TYPE = 0.04, 1e-6, "dapo"  # bench/grpo_step.py's (TRL's defaults)
Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="0.5b", help="shape of the random model: Qwen2.5 0.5b, 1.5b, 3b, 7b; llama3.1-8b, qwen3-8b")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 32; 4 with --smoke)")
    p.add_argument("--num_generations", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--prompt_len", type=int, default=128, help="tokens per (random) prompt")
    p.add_argument("--median", type=float, default=1024, help="median drawn completion length (tokens)")
    p.add_argument("--cap", type=int, default=8192, help="max_completion_length: draws above it are cut there")
    p.add_argument("--sigma", type=float, default=None,
                   help="lognormal σ of the lengths; default ln(cap / median) / 2.326 (99th percentile = cap)")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps per mode, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each mode left out of the means (>= 1)")
    p.add_argument("--max_staleness", type=int, default=None,
                   help="L of the async mode; default cohort's: 2 with partial rollouts, else 1")
    p.add_argument("--processes", type=int, default=1,
                   help="processes (GPUs) per mode, under torchrun: sync is DDP over all of them, async with "
                        "--rollout_gpus K samples on K of them and trains on the others; same global batch")
    p.add_argument("--rollout_gpus", type=int, default=0, help="with --processes: the async mode's sampling ranks")
    p.add_argument("--partial_rollouts", nargs="?", const="true", default="auto", choices=["auto", "true", "false"],
                   help="the async mode's sampling ranks run partial rollouts (a step takes the first groups to "
                        "complete; the rest go on next call); default cohort's: auto, on with --rollout_gpus")
    p.add_argument("--worker", choices=["sync", "async"], help=argparse.SUPPRESS)  # one mode, under torchrun
    p.add_argument("--result", help=argparse.SUPPRESS)  # where rank 0 of a worker writes its mode's result
    p.add_argument("--modes", default="sync,async", help="which modes to run, in order")
    p.add_argument("--per_device", type=int, default=32, help="per_device_train_batch_size (rows per micro-batch)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a GRPOConfig field for both modes (repeatable), e.g. --option max_tokens_per_micro_batch=0")
    p.add_argument("--precapture", choices=["on", "off"], default="on",
                   help="CUDA: capture every decode graph before train() (see the docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang_dump_s", type=float, default=300,
                   help="print every thread's Python stack (each rank) if train() still runs after this many "
                        "seconds, as a hung run does; 0: never")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else runs/async_rollouts_bench)")
    p.add_argument("--curves", action="store_true", help="also the learning curves on the arithmetic task (CPU)")
    p.add_argument("--curves_only", action="store_true", help="only the learning curves")
    p.add_argument("--curve_steps", type=int, default=60)
    p.add_argument("--curve_eval_steps", type=int, default=10)
    p.add_argument("--curve_eval_limit", type=int, default=200, help="held-out problems per evaluation")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny random model, lengths median 8 / cap 48, 3 steps per mode: checks the plumbing")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.num_generations, args.prompt_len = "cpu", 4, 16
        args.prompts = args.prompts or 4
        args.median, args.cap, args.steps, args.warmup = 8.0, 48, 3, 1
        args.curve_steps, args.curve_eval_steps, args.curve_eval_limit = 3, 2, 16
    args.prompts = args.prompts or 32
    if args.curves_only:
        args.curves = True
    if args.sigma is None:
        args.sigma = math.log(args.cap / args.median) / Z99 if args.cap > args.median else 0.5
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup}: it must be at least 1 (a step's wall time runs from the previous step's "
                f"end) and below --steps {args.steps}")
    if args.processes < 1 or not 0 <= args.rollout_gpus < args.processes or (args.rollout_gpus and args.processes == 1):
        p.error(f"--processes {args.processes} --rollout_gpus {args.rollout_gpus}: give 0 < K < N sampling ranks, or none")
    wanted = {"auto": "auto", "true": True, "false": False}[args.partial_rollouts]
    if wanted is True and (not args.rollout_gpus or (args.max_staleness is not None and args.max_staleness < 2)):
        p.error("--partial_rollouts runs on sampling ranks and carries groups 2 updates: give --rollout_gpus K "
                "and --max_staleness 2 or more")
    # What a GRPOConfig with these settings gets (our engine samples here, without tools), passed explicitly.
    asked = SimpleNamespace(partial_rollouts=wanted, rollout_gpus=args.rollout_gpus, max_staleness=args.max_staleness)
    settled = partial_rollout_settings(asked, engine=True, tools=False)
    args.partial_rollouts, args.max_staleness = settled["partial_rollouts"], settled["max_staleness"]
    for mode, ranks in (("sync", args.processes), ("async", args.processes - args.rollout_gpus)):
        if args.prompts % ranks:
            p.error(f"--prompts {args.prompts} do not split over the {ranks} training ranks of the {mode} mode")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not set(args.modes) <= {"sync", "async"} or not args.modes:
        p.error(f"--modes {args.modes}: sync and/or async")
    return args


# ------------------------------------------------------------------------------------ the lengths

class LengthDraws:
    """Per-completion stop lengths: ceil(median · exp(σ · z)), z ~ N(0, 1), at least 1 (uncapped: the engine
    caps them at max_new_tokens). Each completion's draw is keyed by (seed, the call's sampling seed, its
    index in the step's batch: the call's sequence offset + its row), so a step draws the same lengths however
    its batch is split over ranks or merged into one engine call."""

    def __init__(self, median: float, sigma: float, seed: int):
        self.median, self.sigma, self.seed = median, sigma, seed

    def draw(self, call_seed: int | None, offset: int, count: int) -> list[int]:
        call = 0 if call_seed is None else call_seed & 0xFFFFFFFF
        z = np.array([np.random.default_rng([self.seed, call, offset + row]).standard_normal() for row in range(count)])
        return np.maximum(1, np.ceil(self.median * np.exp(self.sigma * z))).astype(np.int64).tolist()

    def describe(self, cap: int, batch: int) -> dict:
        """The capped distribution, from 200,000 draws: quantiles, mean, share at the cap, expected longest."""
        z = np.random.default_rng(12345).standard_normal(200_000)
        lengths = np.minimum(cap, np.maximum(1, np.ceil(self.median * np.exp(self.sigma * z))))
        at_cap = float((lengths >= cap).mean())
        quantiles = {f"p{q}": float(np.quantile(lengths, q / 100)) for q in (10, 50, 90, 99)}
        longest = np.minimum(cap, np.ceil(self.median * np.exp(self.sigma * np.random.default_rng(1).standard_normal(
            (2000, batch)).max(axis=1))))
        return dict(median=self.median, sigma=round(self.sigma, 4), cap=cap, mean=round(float(lengths.mean()), 1),
                    share_at_cap=round(at_cap, 4), expected_at_cap_per_step=round(at_cap * batch, 2),
                    expected_longest=round(float(longest.mean()), 1), **quantiles)


def count_ending(counts: dict, reason: str, n: int, limit: int, cap: int) -> str:
    """Tally in `counts` how a completion of `n` tokens, drawn to stop at `limit` (at most the cap), ended, and
    return its finish reason as the trainer should see it."""
    if reason == "stop":  # the model sampled EOS itself (at or before its drawn length)
        counts["eos_stops"] += 1
        counts["violations"] += n > limit
        return reason
    if n == limit < cap:  # stopped at its drawn length: what an EOS there would do
        counts["imposed_stops"] += 1
        return "stop"
    if n == limit:  # its draw reached the cap: truncated, as a real overlong completion
        counts["cap_stops"] += 1
    else:
        counts["violations"] += 1
    return reason


class DrawnLengthEngine(Engine):
    """cohort's `Engine`; each completion stops at its drawn length (see the docstring). `calls` records each
    generate() call: its clock, the drawn and sampled lengths, how each completion ended, the engine's stats."""

    def __init__(self, model, tokenizer=None, *, lengths: LengthDraws, **options):
        super().__init__(model, tokenizer, **options)
        self.lengths = lengths
        self.calls: list[dict] = []
        self.carried: dict[tuple, list] = {}  # partial rollouts: context -> [(drawn length, tokens so far)]
        self._drawn: list[int] | None = None

    def generate(self, prompt_ids, num_generations, params, turns=None):
        count = len(prompt_ids) * num_generations
        drawn = self.lengths.draw(params.seed, params.sequence_offset, count)
        self._drawn = drawn
        started = time.perf_counter()
        try:
            rollout = super().generate(prompt_ids, num_generations, params, turns=turns)
        finally:
            self._drawn = None
        ended = time.perf_counter()
        lengths = [int(n) for n in rollout.completion_mask.sum(dim=1).tolist()]
        counts = dict(imposed_stops=0, eos_stops=0, cap_stops=0, violations=0)
        drawn = [min(d, params.max_new_tokens) for d in drawn]
        rollout.finish_reasons = [count_ending(counts, reason, n, limit, params.max_new_tokens)
                                  for reason, n, limit in zip(rollout.finish_reasons, lengths, drawn)]
        self.record_call(params, started, ended, drawn, lengths, counts)
        return rollout

    def generate_until(self, prompt_ids, limits, params, enough):
        """Partial rollouts: a fresh completion draws its length as `generate` does; a continued one keeps the
        length drawn when it started (found by its context: prompt + its tokens so far)."""
        fresh = self.lengths.draw(params.seed, params.sequence_offset, len(prompt_ids))
        drawn, earlier = [], []
        for row, prompt in enumerate(prompt_ids):
            waiting = self.carried.get(tuple(prompt))  # completions not admitted yet share their context
            total, done = waiting.pop(0) if waiting else (min(fresh[row], params.max_new_tokens), 0)
            if waiting == []:
                del self.carried[tuple(prompt)]
            drawn.append(total)
            earlier.append(done)
        limits = [min(limit, total - done) for limit, total, done in zip(limits, drawn, earlier)]
        started = time.perf_counter()
        sequences = super().generate_until(prompt_ids, limits, params, enough)
        ended = time.perf_counter()
        counts = dict(imposed_stops=0, eos_stops=0, cap_stops=0, violations=0, paused=0)
        for prompt, seq, total, done in zip(prompt_ids, sequences, drawn, earlier):
            n = done + len(seq.tokens)
            if seq.finish_reason is None:
                counts["paused"] += 1
                self.carried.setdefault(tuple(prompt) + tuple(seq.tokens.tolist()), []).append((total, n))
            else:
                seq.finish_reason = count_ending(counts, seq.finish_reason, n, total, params.max_new_tokens)
        self.record_call(params, started, ended, drawn, [len(seq.tokens) for seq in sequences], counts)
        return sequences

    def record_call(self, params, started: float, ended: float, drawn: list[int], lengths: list[int],
                    counts: dict) -> None:
        """One entry of `calls`: the clock, the drawn lengths and the tokens sampled in this call, how the
        completions ended, the engine's stats."""
        self.calls.append(dict(seed=params.seed, started=started, ended=ended, seconds=ended - started, drawn=drawn,
                               lengths=lengths, tokens=sum(lengths), longest=max(lengths), **counts,
                               decode_steps=int(self.stats.get("decode_steps", 0)),
                               decode_row_steps=int(self.stats.get("decode_row_steps", 0)),
                               graph_captures=int(self.stats.get("graph_captures", 0)),
                               graphs_enabled=bool(self.graphs.enabled)))

    def _prefill(self, admitted, params):
        if self._drawn is not None:
            for seq in admitted:
                if seq.turn == 0:  # the first time the sequence enters a slot
                    seq.limit = min(seq.limit, self._drawn[seq.index])
        super()._prefill(admitted, params)


def drawn_length_samplers(lengths: LengthDraws):
    """A `sampler_factory` for the trainer (or a sampling rank) that makes `DrawnLengthEngine`s (the trainer's own
    and, with async rollouts, the producer's), and the list of those it made."""
    from cohort_grpo.models.lora import base_model

    made: list[DrawnLengthEngine] = []

    def make_sampler(model, tokenizer=None, **options):
        engine = DrawnLengthEngine(base_model(model), tokenizer, lengths=lengths, **options)
        made.append(engine)
        return engine

    return make_sampler, made


def precapture(engine: Engine, sequences: int, prompt_len: int, config, pad_id: int) -> tuple[int, float]:
    """Capture every decode graph a call of `sequences` completions of `prompt_len`-token prompts can use
    (every width bucket × KV-length bucket), now, while nothing else runs. (graphs, seconds); 0 off CUDA."""
    from cohort_grpo.rollout.engine_setup import KV_LENGTH_STEP, sampling_mode
    from cohort_grpo.rollout.sampling import sampling_key
    from cohort_grpo.rollout.sampler import SamplingParams
    from cohort_grpo.rollout.scheduler import batch_buckets

    if not engine.graphs.enabled:
        return 0, 0.0
    started = time.perf_counter()
    cap = config.max_completion_length
    engine.capture_graphs(sequences, prompt_len + cap, cap, pad_token_id=pad_id)  # sizes cache and state
    rows, max_len = engine.cache.num_rows, engine.cache.max_len
    key = sampling_key(SamplingParams(max_new_tokens=cap, temperature=config.temperature, top_p=config.top_p,
                                       top_k=config.top_k, min_p=config.min_p))
    with sampling_mode(engine.model, fused=engine.compile_kernels):
        for width in [w for w in batch_buckets(engine.max_batch_size) if w <= rows]:
            for cache_len in sorted({*range(KV_LENGTH_STEP, max_len, KV_LENGTH_STEP), max_len}):
                engine.graphs(width, cache_len, key)
    torch.cuda.synchronize()
    return len(engine.graphs.graphs), time.perf_counter() - started


# ------------------------------------------------------------------------------------ the trainer

class StepClock:
    """A TrainerCallback: the time each step begins and ends (after the step's record; on CUDA the phases
    have synchronised the device by then)."""

    def __init__(self):
        self.begin: dict[int, float] = {}
        self.end: dict[int, float] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin[state.global_step + 1] = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.end[state.global_step] = time.perf_counter()

    def walls(self, steps: list[int]) -> list[float]:
        """Each step's wall time: from the previous step's end (the first: from its own beginning)."""
        ends = [self.end[step] for step in steps]
        return [end - start for end, start in zip(ends, [self.begin[steps[0]]] + ends[:-1])] if steps else []


def numeric(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def parse_option(text: str):
    key, _, value = text.partition("=")
    for convert in (int, float):
        try:
            return key.strip(), convert(value)
        except ValueError:
            pass
    lowered = value.strip().lower()
    if lowered in ("true", "false"):
        return key.strip(), lowered == "true"
    return key.strip(), None if lowered == "none" else value


def training_ranks(args, mode: str) -> int:
    """Ranks that train in `mode` (the global batch is split over them)."""
    return args.processes - (args.rollout_gpus if mode == "async" else 0)


def mode_config(args, mode: str, output_dir: str):
    from cohort_grpo import GRPOConfig

    prompts = args.prompts // training_ranks(args, mode)  # per training rank
    batch = prompts * args.num_generations
    per_device = min(args.per_device, batch)
    if batch % per_device:
        raise SystemExit(f"{prompts} prompts × G={args.num_generations} = {batch} completions a rank is not a "
                         f"multiple of --per_device {per_device}")
    options = dict(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=batch // per_device,
        num_generations=args.num_generations, max_prompt_length=args.prompt_len, max_completion_length=args.cap,
        beta=BETA, num_iterations=1, learning_rate=LEARNING_RATE, temperature=1.0, top_k=0, top_p=1.0, dtype="auto",
        max_steps=args.steps, loss_type=LOSS_TYPE, gradient_checkpointing=args.device != "cpu",
        max_tokens_per_micro_batch=0 if args.device == "cpu" else 65536, eval_steps=0, save_steps=0,
        log_completions_steps=10**6, report_to="none", seed=args.seed, device=args.device, quiet=True,
        async_rollouts=mode == "async", max_staleness=args.max_staleness,
        rollout_gpus=args.rollout_gpus if mode == "async" else 0,
        partial_rollouts=mode == "async" and args.partial_rollouts)
    options.update(dict(parse_option(o) for o in args.option))
    config = GRPOConfig(**options)
    assert config.prompts_per_step == prompts, (config.prompts_per_step, prompts)
    return config


def run_mode(args, mode: str, shape: dict, lengths: LengthDraws) -> dict:
    """One mode through GRPOTrainer.train(): per-step records joined with the engine calls that made them."""
    from grpo_step_worker import build_module, make_prompts, make_reward, make_tokenizer, unsaved_trainer

    from cohort_grpo import SamplingRank, is_sampling_rank

    vocab = shape["vocab_size"]
    tokenizer = make_tokenizer(vocab)
    rows = make_prompts(vocab, args.prompts * max(8, args.steps + 2), args.prompt_len)
    prompt_lengths = {len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows[:8]}
    if prompt_lengths != {args.prompt_len}:
        raise RuntimeError(f"prompts tokenise to {sorted(prompt_lengths)} tokens, not {args.prompt_len}")
    scratch = tempfile.mkdtemp(prefix=f"async-bench-{mode}-")
    config = mode_config(args, mode, scratch)
    clock = StepClock()
    started = time.perf_counter()
    device = args.device
    if args.processes > 1 and device == "cuda":  # under torchrun: this rank's GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    model = build_module(shape, device)  # the same seed (0) for both modes: the same initial weights
    factory, engines = drawn_length_samplers(lengths)
    log = lambda line: print(f"  [{mode}] {line}", flush=True)  # noqa: E731
    trainer = sampler = None
    if is_sampling_rank(config):  # --rollout_gpus: this rank only samples, for the trainers it serves
        sampler = SamplingRank(model, config, processing_class=tokenizer, sampler_factory=factory, log=log)
    else:
        trainer = unsaved_trainer()(model=model, reward_funcs=[make_reward(args.cap)], train_dataset=rows,
                                    args=config, processing_class=tokenizer, callbacks=[clock],
                                    sampler_factory=factory, log=log)
    if sampler is not None:  # a sampling rank: its engine is the server's
        sampling_engine = sampler.sampler
    else:  # the engine the trainer's rollouts come from: None where a sampling rank samples them
        sampling_engine = trainer.rollouts.sampler
    if sampling_engine is not None and not isinstance(sampling_engine, DrawnLengthEngine):
        sampling_engine = sampling_engine.sampler  # the colocated placement: a tensor-parallel group's wrapper
    assert sampling_engine is None or isinstance(sampling_engine, DrawnLengthEngine), type(sampling_engine)
    setup = time.perf_counter() - started
    graphs, capture_s = 0, 0.0
    if args.device != "cpu" and args.precapture == "on" and sampling_engine is not None:
        # One engine call per step (a sampling rank samples the shares of all the trainers it serves at once).
        served = len(sampler.server.trainers) if sampler is not None else 1
        in_flight = 2 if config.partial_rollouts else 1  # partial rollouts: a second batch of groups in flight
        sequences = config.prompts_per_step * args.num_generations * served * in_flight
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        graphs, capture_s = precapture(sampling_engine, sequences, args.prompt_len, config, pad_id)
        print(f"  [{mode}] precaptured {graphs} decode graphs in {capture_s:.1f} s", flush=True)
    train_started = time.perf_counter()
    if args.hang_dump_s > 0:  # a run still going then has hung: every thread's stack, on every rank
        faulthandler.dump_traceback_later(args.hang_dump_s, exit=False)
    try:
        if sampler is not None:
            sampler.serve()
        else:
            trainer.train()
    finally:
        faulthandler.cancel_dump_traceback_later()
    train_s = time.perf_counter() - train_started
    calls = sorted((c for e in engines for c in e.calls), key=lambda c: c["started"])
    if sampler is not None:
        shutil.rmtree(scratch, ignore_errors=True)
        return None  # rank 0 gives the results
    if args.processes > 1:
        return distributed_result(args, mode, trainer, clock, setup, graphs, capture_s, train_started, train_s, calls,
                                  scratch)
    history = [numeric(r) for r in trainer.history]
    if len(calls) != len(history):
        raise RuntimeError(f"{mode}: {len(calls)} engine calls for {len(history)} steps (one per step expected)")
    steps = []
    walls = clock.walls([int(record["step"]) for record in history])
    for record, call, wall in zip(history, calls, walls):
        step = int(record["step"])
        end = clock.end[step]
        steps.append(dict(
            record, wall=wall, first_wall_from_begin=step == 1, tokens=call["tokens"], longest=call["longest"],
            engine_seconds=call["seconds"], decode_steps=call["decode_steps"],
            graph_captures=call["graph_captures"], graphs_enabled=call["graphs_enabled"],
            imposed_stops=call["imposed_stops"], eos_stops=call["eos_stops"], cap_stops=call["cap_stops"],
            violations=call["violations"], sampling_started=call["started"] - train_started,
            sampling_ended=call["ended"] - train_started, step_ended=end - train_started,
            drawn=call["drawn"], lengths=call["lengths"]))
    result = dict(mode=mode, setup_s=round(setup, 2), precapture_graphs=graphs, precapture_s=round(capture_s, 2),
                  train_s=round(train_s, 2), steps=steps,
                  graphs_enabled_at_end=all(e.graphs.enabled for e in engines if e.calls),
                  sampler_correction=trainer.sampler_correction, config={k: getattr(config, k) for k in (
                      "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                      "max_completion_length", "max_tokens_per_micro_batch", "gradient_checkpointing", "beta",
                      "loss_type", "async_rollouts", "max_staleness", "dtype")})
    del trainer, model, engines, sampling_engine
    gc.collect()
    if args.device != "cpu":
        torch.cuda.empty_cache()
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def distributed_result(args, mode, trainer, clock, setup, graphs, capture_s, train_started, train_s, calls,
                       scratch) -> dict | None:
    """One rank's part of a mode under torchrun: rank 0's per-step records (tokens from the global mean
    length: this rank's engine saw only its share), None elsewhere."""
    shutil.rmtree(scratch, ignore_errors=True)
    if not trainer.parallel.is_main:
        return None
    batch = args.prompts * args.num_generations
    history = [numeric(r) for r in trainer.history]
    steps = [dict(record, wall=wall, first_wall_from_begin=record["step"] == 1,
                  tokens=round(record["completions/mean_length"] * batch), longest=None, engine_seconds=None,
                  decode_steps=None, graph_captures=0, eos_stops=0, cap_stops=0,
                  step_ended=clock.end[int(record["step"])] - train_started)
             for record, wall in zip(history, clock.walls([int(r["step"]) for r in history]))]
    return dict(mode=mode, setup_s=round(setup, 2), precapture_graphs=graphs, precapture_s=round(capture_s, 2),
                train_s=round(train_s, 2), steps=steps, graphs_enabled_at_end=True, ranks=args.processes,
                training_ranks=training_ranks(args, mode), rank0_engine_calls=len(calls),
                sampler_correction=trainer.sampler_correction)


def launch_mode(args, mode: str, argv: list[str]) -> dict:
    """Run `mode` under torchrun on --processes processes (this script again, as a worker); rank 0's result."""
    import subprocess

    result = Path(tempfile.mkdtemp(prefix=f"async-bench-{mode}-")) / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}",
               str(Path(__file__).resolve()), *argv, "--worker", mode, "--result", str(result)]
    done = subprocess.run(command, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"{mode} on {args.processes} processes failed (exit {done.returncode})")
    return json.loads(result.read_text())


def run_worker(args) -> None:
    """One mode on this rank (under torchrun); rank 0 writes the result."""
    from grpo_step_worker import SHAPES, SMOKE

    if args.smoke:
        torch.set_num_threads(1)
    shape = (SMOKE if args.smoke else SHAPES)[args.model]
    result = run_mode(args, args.worker, shape, LengthDraws(args.median, args.sigma, args.seed))
    if result is not None:
        Path(args.result).write_text(json.dumps(result, default=str))


def summarize(result: dict, warmup: int, prompt_tokens_per_step: int = 0, gpus: int = 1) -> dict:
    """Means over the measured steps (after the warm-up). `tok_per_s_per_gpu` is NeMo-RL's throughput
    figure: every token of a step's sequences, prompts and completions, over step time × GPUs."""
    measured = [s for s in result["steps"] if s["step"] > warmup]

    def mean(key):
        values = [s[key] for s in measured if s.get(key) is not None]
        return statistics.mean(values) if values else None

    tokens, wall = sum(s["tokens"] for s in measured), sum(s["wall"] for s in measured)
    prompt_tokens = prompt_tokens_per_step * len(measured)
    summary = dict(mode=result["mode"], measured_steps=len(measured), tokens_per_step=mean("tokens"),
                   tok_per_s=tokens / wall if wall else None,
                   tok_per_s_per_gpu=(tokens + prompt_tokens) / (wall * gpus) if wall else None, wall_s=mean("wall"), step_time_s=mean("step_time"),
                   engine_s=mean("engine_seconds"), longest=mean("longest"), decode_steps=mean("decode_steps"),
                   graph_captures=sum(s["graph_captures"] for s in measured),
                   peak_memory_gib=max((s.get("peak_memory_gib") or 0.0 for s in result["steps"]), default=None) or None,
                   staleness=mean("async/staleness"), clipped_ratio=mean("completions/clipped_ratio"),
                   eos_stops=sum(s["eos_stops"] for s in measured), cap_stops=sum(s["cap_stops"] for s in measured))
    for key in PHASES + SAMPLING_KEYS + (WEIGHT_SYNC,):
        summary[key] = mean(key)
    if result["mode"] == "async" and summary["engine_s"] is not None and summary["time/sampling"] is not None:
        summary["hidden_sampling_s"] = summary["engine_s"] - summary["time/sampling"]  # sampled while others ran
    return summary


def fmt(value, spec: str = ".2f", none: str = "—") -> str:
    return none if value is None else format(value, spec)


def markdown(summaries: list[dict], header: str) -> str:
    columns = ("mode", "steps", "completion tok/s (whole step)", "tok/s/GPU (NeMo-RL: prompt + completion)", "step wall s", "trainer step_time s",
               "sampling wait s", "engine sampling s (async: the producer's)", "update s", "π_ref log-probs s",
               "weight sync s (sampling ranks)",
               "tokens / step", "longest", "staleness", "logp diff mean / max", "IS ratio min / mean / max", "peak GiB")
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for s in summaries:
        lines.append(
            f"| {s['mode']} | {s['measured_steps']} | {fmt(s['tok_per_s'], ',.0f')} "
            f"| {fmt(s.get('tok_per_s_per_gpu'), ',.0f')} | {fmt(s['wall_s'])} "
            f"| {fmt(s['step_time_s'])} | {fmt(s['time/sampling'])} | {fmt(s['engine_s'])} | {fmt(s['time/update'])} "
            f"| {fmt(s['time/logprobs'])} | {fmt(s.get(WEIGHT_SYNC), '.3f')} | {fmt(s['tokens_per_step'], ',.0f')} "
            f"| {fmt(s['longest'], '.0f')} "
            f"| {fmt(s['staleness'], '.0f')} | {fmt(s[SAMPLING_KEYS[0]], '.2e')} / {fmt(s[SAMPLING_KEYS[1]], '.2e')} "
            f"| {fmt(s[SAMPLING_KEYS[2]], '.3f')} / {fmt(s[SAMPLING_KEYS[3]], '.3f')} / {fmt(s[SAMPLING_KEYS[4]], '.3f')} "
            f"| {fmt(s['peak_memory_gib'], '.1f')} |")
    by_mode = {s["mode"]: s for s in summaries}
    if {"sync", "async"} <= set(by_mode) and by_mode["sync"]["tok_per_s"] and by_mode["async"]["tok_per_s"]:
        lines.append("")
        lines.append(f"async / sync: {by_mode['async']['tok_per_s'] / by_mode['sync']['tok_per_s']:.2f}× the completion "
                     f"tokens per second; step wall {by_mode['async']['wall_s']:.2f} s against "
                     f"{by_mode['sync']['wall_s']:.2f} s")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the curves

def run_curves(args, out: Path) -> dict:
    """Both modes on the built-in arithmetic task, its default model and options, on the CPU."""
    from cohort_grpo.cli import task_rows
    from cohort_grpo.config.command_line import resolve_config
    from cohort_grpo.tasks import get_task

    from grpo_step_worker import unsaved_trainer

    BenchTrainer = unsaved_trainer()
    curves = {}
    for mode in args.modes:
        scratch = tempfile.mkdtemp(prefix=f"async-curves-{mode}-")
        argv = ["--task", "arithmetic", "--device", "cpu", "--max_steps", str(args.curve_steps), "--eval_steps",
                str(args.curve_eval_steps), "--eval_limit", str(args.curve_eval_limit), "--output_dir", scratch,
                "--quiet", "true", "--seed", str(args.seed), "--log_completions_steps", str(10**6)]
        if mode == "async":
            argv += ["--async_rollouts", "true", "--max_staleness", str(args.max_staleness)]
        config, _ = resolve_config(argv)
        task = get_task(config.task)
        train_rows, eval_rows = task_rows(task, config, log=lambda line: None)
        started = time.perf_counter()
        trainer = BenchTrainer(config.model, None, train_rows, args=config, eval_dataset=eval_rows, task=task,
                               log=lambda line, m=mode: print(f"  [curves {m}] {line}", flush=True))
        trainer.train()
        seconds = time.perf_counter() - started
        history = [numeric(r) for r in trainer.history]
        evals = [dict(step=int(r["step"]), accuracy=r["eval/accuracy"]) for r in trainer.state.log_history
                 if "eval/accuracy" in r]
        curves[mode] = dict(
            seconds=round(seconds, 1), accuracy_before=trainer.accuracy_before, accuracy_after=trainer.accuracy_after,
            steps=[int(r["step"]) for r in history], reward=[r["reward"] for r in history],
            success=[r["success"] for r in history], staleness=[r.get("async/staleness") for r in history],
            importance_ratio_mean=[r.get(SAMPLING_KEYS[3]) for r in history], eval=evals)
        print(f"  [curves {mode}] {seconds:.1f} s, held-out accuracy {trainer.accuracy_before} -> "
              f"{trainer.accuracy_after}", flush=True)
        del trainer
        gc.collect()
        shutil.rmtree(scratch, ignore_errors=True)
    result = dict(bench="async_rollouts_curves", task="arithmetic (default options, built-in tiny model)",
                  max_staleness=args.max_staleness, steps=args.curve_steps, eval_steps=args.curve_eval_steps,
                  eval_limit=args.curve_eval_limit, seed=args.seed, curves=curves)
    (out / "async_rollouts_curves.json").write_text(json.dumps(result, indent=1) + "\n")
    result["png"] = plot_curves(curves, out / "async_rollouts_curves.png", args)
    return result


def plot_curves(curves: dict, path: Path, args) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:  # noqa: BLE001 - the JSON is the result; the figure is a convenience
        print(f"  no PNG: matplotlib does not import ({type(error).__name__}: {error})", flush=True)
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"sync": "synchronous", "async": f"async rollouts (max_staleness={args.max_staleness})"}
    for mode, curve in curves.items():
        rewards = np.array(curve["reward"], dtype=float)
        window = max(1, min(10, len(rewards) // 5))
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        line, = left.plot(curve["steps"], rewards, alpha=0.25)
        left.plot(curve["steps"][window - 1:], smooth, color=line.get_color(), label=labels[mode])
        right.plot([e["step"] for e in curve["eval"]], [100 * e["accuracy"] for e in curve["eval"]], marker="o",
                   color=line.get_color(), label=labels[mode])
    left.set(xlabel="step", ylabel="mean reward", title=f"reward (moving mean of {window})")
    right.set(xlabel="step", ylabel="held-out greedy accuracy (%)", title="held-out accuracy")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle("cohort, arithmetic task (tiny model, CPU): synchronous vs asynchronous rollouts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ------------------------------------------------------------------------------------ checks and main

def smoke_checks(results: dict, args) -> None:
    """Both modes ran every step; async steps carry their staleness and the sampling/* metrics; every
    completion stopped at its drawn length (or earlier at a sampled EOS); both modes drew the same lengths."""
    for mode in args.modes:
        steps = results[mode]["steps"]
        assert [s["step"] for s in steps] == list(range(1, args.steps + 1)), (mode, [s["step"] for s in steps])
        for s in steps if args.processes == 1 else ():  # under torchrun rank 0 sees no engine of the other ranks
            assert s["violations"] == 0, (mode, s["step"], "a completion ran past its drawn length")
            assert s["imposed_stops"] + s["eos_stops"] + s["cap_stops"] == len(s["lengths"])
            for drawn, n in zip(s["drawn"], s["lengths"]):
                assert n <= drawn, (mode, s["step"], drawn, n)
            assert s["tokens"] == round(s["completions/mean_length"] * len(s["lengths"])), (mode, s["step"])
    if "async" in results:
        for s in results["async"]["steps"]:
            expected = min(s["step"] - 1, args.max_staleness)  # the first L + 1 rollouts come from the initial weights
            if args.partial_rollouts:  # fresh groups 1 version old, carried ones up to L
                assert s["step"] == 1 or 1 <= s.get("async/staleness") <= args.max_staleness, s
                assert "async/carried_groups" in s and s["async/dropped_groups"] == 0, s
                continue
            assert s.get("async/staleness") == expected, (s["step"], s.get("async/staleness"), expected)
            missing = [k for k in SAMPLING_KEYS if k not in s]
            assert not missing, (s["step"], missing)
        assert args.partial_rollouts or any(s["async/staleness"] == args.max_staleness for s in results["async"]["steps"])
    if {"sync", "async"} <= set(results) and args.processes == 1:
        for a, b in zip(results["sync"]["steps"], results["async"]["steps"]):
            assert a["drawn"] == b["drawn"], (a["step"], "the modes drew different lengths")
    print(f"smoke: OK — modes {args.modes} ran {args.steps} steps each; async staleness "
          f"{[s.get('async/staleness') for s in results.get('async', {}).get('steps', [])]}, sampling/* present; "
          "every completion stopped at its drawn length or at a sampled EOS; both modes drew the same lengths",
          flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available() and not args.curves_only:
        raise SystemExit("no CUDA device: run with --smoke (or --curves_only) on a CPU")
    if args.smoke:
        torch.set_num_threads(1)  # a shared CPU: more threads only wait on each other
    out = Path(args.out or os.environ.get("OUT") or (tempfile.mkdtemp(prefix="async-bench-") if args.smoke
                                                      else ROOT / "runs" / "async_rollouts_bench"))
    out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name() if args.device != "cpu" and torch.cuda.is_available() else \
        f"cpu ({os.cpu_count()} cores)"
    command = "python " + " ".join([sys.argv[0]] + sys.argv[1:]) if argv is None else "main(" + repr(argv) + ")"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"{stamp}  {card}  torch {torch.__version__}  out {out}", flush=True)
    report: dict = dict(bench="async_rollouts", date=stamp, card=card, command=command, torch=torch.__version__)
    started = time.perf_counter()

    if not args.curves_only:
        from grpo_step_worker import SHAPES, SMOKE

        shape = (SMOKE if args.smoke else SHAPES)[args.model]
        lengths = LengthDraws(args.median, args.sigma, args.seed)
        batch = args.prompts * args.num_generations
        distribution = lengths.describe(args.cap, batch)
        print(f"lengths: {json.dumps(distribution)}", flush=True)
        name = f"qwen2.5-{args.model}" if args.model[0].isdigit() else args.model
        report.update(model=f"{name} shape (random)" if not args.smoke else f"tiny {name} family (random)",
                      dtype="bfloat16" if args.device != "cpu" else "float32",
                      workload=dict(prompts=args.prompts, G=args.num_generations, completions=batch,
                                    prompt_len=args.prompt_len, steps=args.steps, warmup=args.warmup,
                                    max_staleness=args.max_staleness, options=args.option, precapture=args.precapture,
                                    processes=args.processes, rollout_gpus=args.rollout_gpus,
                                    partial_rollouts=args.partial_rollouts),
                      lengths=distribution, modes={}, errors={})
        results = {}
        for mode in args.modes:
            print(f"\n== {mode}: {args.steps} steps ({args.warmup} warm-up), {batch} completions per step "
                  f"(elapsed {time.perf_counter() - started:.0f} s)", flush=True)
            try:
                results[mode] = (launch_mode(args, mode, list(sys.argv[1:] if argv is None else argv)) if args.processes > 1
                                 else run_mode(args, mode, shape, lengths))
            except Exception as error:  # noqa: BLE001 - keep the other mode's figures; say what failed
                if args.smoke:
                    raise
                report["errors"][mode] = f"{type(error).__name__}: {error}"[:600]
                print(f"{mode} failed: {report['errors'][mode]}", flush=True)
                import traceback

                traceback.print_exc()
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            summary = summarize(results[mode], args.warmup, args.prompts * args.num_generations * args.prompt_len,
                                max(1, args.processes))
            results[mode]["summary"] = summary
            report["modes"][mode] = {k: v for k, v in results[mode].items()}
            print(f"== {mode}: done in {results[mode]['train_s']:.1f} s of training; "
                  f"{json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})}",
                  flush=True)
            (out / "async_rollouts.json").write_text(json.dumps(report, indent=1, default=str) + "\n")  # per mode
        summaries = [results[m]["summary"] for m in args.modes if m in results]
        header = (f"{datetime.date.today().isoformat()}, {card}, `{command}`: {report['model']} in {report['dtype']}, "
                  f"{args.prompts} prompts × G={args.num_generations} = {batch} completions per step, "
                  f"{args.prompt_len}-token prompts, completion lengths lognormal (median {args.median:g}, "
                  f"σ {args.sigma:.3f}, cap {args.cap}: mean {distribution['mean']:g}, p90 {distribution['p90']:g}, "
                  f"p99 {distribution['p99']:g}), means over steps {args.warmup + 1}–{args.steps} of each mode; "
                  + (f"async = async_rollouts, max_staleness={args.max_staleness}, one producer thread on the same "
                     "device" if args.processes == 1 else
                     f"{args.processes} processes: sync = DDP over all of them; async = max_staleness="
                     f"{args.max_staleness}, rollout_gpus={args.rollout_gpus} ranks sampling for "
                     f"{args.processes - args.rollout_gpus} training ranks"
                     + (", partial rollouts" if args.partial_rollouts else "")))
        table = markdown(summaries, header)
        print("\n" + table + "\n", flush=True)
        notes = []
        for mode, r in results.items():
            if not r["graphs_enabled_at_end"] and args.device != "cpu":
                notes.append(f"{mode}: the sampling engine's CUDA graphs were disabled during the run (a capture "
                             "failed; see stderr) — its decode ran eagerly")
            if r["summary"]["graph_captures"]:
                notes.append(f"{mode}: {r['summary']['graph_captures']} CUDA-graph captures inside the measured steps")
        for note in notes:
            print(f"NOTE: {note}", flush=True)
        report["notes"] = notes
        report["table"] = table
        by_mode = {s["mode"]: s for s in summaries}
        if {"sync", "async"} <= set(by_mode) and by_mode["sync"]["tok_per_s"]:
            report["async_over_sync_tok_per_s"] = by_mode["async"]["tok_per_s"] / by_mode["sync"]["tok_per_s"]
        (out / "async_rollouts.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        (out / "async_rollouts.md").write_text(table + "\n")
        if args.smoke:
            smoke_checks(results, args)

    if args.curves:
        print(f"\n== curves: arithmetic task, {args.curve_steps} steps per mode, CPU "
              f"(elapsed {time.perf_counter() - started:.0f} s)", flush=True)
        curves = run_curves(args, out)
        report["curves"] = {m: dict(seconds=c["seconds"], accuracy_before=c["accuracy_before"],
                                    accuracy_after=c["accuracy_after"]) for m, c in curves["curves"].items()}
        report["curves_files"] = [str(out / "async_rollouts_curves.json")] + ([curves["png"]] if curves["png"] else [])
        if args.smoke:
            for mode, c in curves["curves"].items():
                assert len(c["reward"]) == args.curve_steps and c["eval"], (mode, c)
            print(f"smoke: OK — curves for {list(curves['curves'])}: {report['curves_files']}", flush=True)

    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    line = {k: v for k, v in report.items() if k != "modes"}
    line["summaries"] = {m: r.get("summary") for m, r in report.get("modes", {}).items()}
    print(json.dumps(line, default=str), flush=True)
    return report


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.worker:
        run_worker(parsed)
    else:
        main()
