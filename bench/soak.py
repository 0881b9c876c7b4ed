"""No drift over a long run, on one GPU: a random-weight Qwen2.5-0.5B shape trained for as many steps as one
device call allows (short completions: 16 prompts × 8 generations of 64 tokens, 64-token prompts).

Each step records torch.cuda.memory_allocated / memory_reserved and the process's RSS, the graphs
torch.compile has compiled so far (torch._dynamo's counters), the engine's CUDA-graph captures, the
step's seconds with the trainer's own phase times (`time/*`), and on a GPU the SM clock and power that
nvidia-smi reports: a window that is slow because the card clocked down is the machine, not drift.
The table compares step W (the end of warm-up, 50) with the last step, and the mean step
time of steps W+1..2W with that of the last W steps:

    memory (allocated and reserved; RSS on CPU)   within 2%      PASS / FAIL
    compiled graphs or graph captures after W     none           PASS / FAIL
    step time                                     within 5%      PASS / FAIL

    python bench/soak.py --out soak.json                          # the device run (about 9 minutes)
    python bench/soak.py --device cpu --steps 20 --tiny           # tiny shapes on the CPU: checks the script

Each step's record is appended to soak.jsonl (beside --out) as one line, so a run cut short keeps what it
measured (`--summarize soak.jsonl` summarizes it), and the work between two steps stays the same however long
the run: a JSON of every record rewritten after each step grew with the steps. The JSON (--out, default
$OUT/soak.json or ./soak.json: the records and the summary) is written at the end. The records also hold what
tells the causes of a slower step apart: the trainer's own step time (the rest is the loop's and callbacks'),
the collector's collections by generation and its uncollected gen-2 objects (every 50 steps), the CUDA
allocator's segments, split blocks and cudaMalloc calls, the card's temperature and throttle reasons, and the
recorder's own time (`write_s`, outside every step). The model shapes and synthetic inputs are
bench/grpo_step_worker.py's.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import operator
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shapes and inputs of the step bench
from grpo_step_worker import (SHAPES, SMOKE, build_module, make_prompts, make_reward, make_tokenizer,  # noqa: E402
                               unsaved_trainer)

import torch  # noqa: E402

RUN = dict(prompts=16, generations=8, prompt_len=64, completion_len=64, per_device=32, grad_accum=4)
TINY_RUN = dict(prompts=4, generations=4, prompt_len=16, completion_len=16, per_device=4, grad_accum=4)
LIMITS = dict(memory=0.02, time=0.05)  # relative drift allowed between the end of warm-up and the end


def rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class ClockSampler:
    """nvidia-smi's SM clock (MHz), power (W), temperature (°C) and active clock-throttle reasons (a bit mask),
    sampled every 200 ms in a child process; `since(t)` gives them over the samples since perf_counter time t:
    the means, the hottest temperature, and every throttle reason seen (an empty dict where nvidia-smi is missing;
    a driver that knows no throttle field gives the other three)."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
    NAMES = ("sm_clock_mhz", "power_w", "temperature_c", "throttle_reasons")

    def __init__(self):
        import subprocess
        import threading

        self.samples: collections.deque = collections.deque(maxlen=500)  # 100 s of them: a window is one step
        self.process = None
        for fields in (self.FIELDS, self.FIELDS[:3]):
            query = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", "0"]
            try:
                if subprocess.run(query, capture_output=True, timeout=10).returncode != 0:
                    continue  # a field this driver does not know
                self.process = subprocess.Popen(query + ["-lms", "200"], stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, text=True)
            except (OSError, subprocess.TimeoutExpired):
                return
            break
        if self.process is not None:
            threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.process.stdout:
            parts = [x.strip() for x in line.split(",")]
            try:
                values = [float(x) for x in parts[:3]] + [int(x, 16) for x in parts[3:4]]
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), *values))

    def since(self, start: float) -> dict:
        window = [sample[1:] for sample in list(self.samples) if sample[0] >= start]
        if not window:
            return {}
        out = {}
        for i, name in enumerate(self.NAMES[:len(window[0])]):
            column = [sample[i] for sample in window]
            if name == "temperature_c":
                out[name] = max(column)
            elif name == "throttle_reasons":
                out[name] = hex(functools.reduce(operator.or_, column, 0))
            else:
                out[name] = round(sum(column) / len(column), 1)
        return out

    def stop(self):
        if self.process is not None:
            self.process.terminate()


def compiled_graphs() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process: a recompilation adds one."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))


def allocator_counts() -> dict:
    """The CUDA caching allocator's block counts: a pool that fragments makes more segments and more inactive split
    blocks, and calls cudaMalloc/cudaFree again (a step that slows by a search or a re-allocation, memory flat)."""
    stats = torch.cuda.memory_stats()
    return {"segments": stats.get("segment.all.current", 0), "active_blocks": stats.get("active.all.current", 0),
            "inactive_split_blocks": stats.get("inactive_split.all.current", 0),
            "inactive_split_mib": round(stats.get("inactive_split_bytes.all.current", 0) / 2**20, 1),
            "device_allocs": stats.get("num_device_alloc", 0), "device_frees": stats.get("num_device_free", 0),
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def step_recorder(trainer_box: dict, records: list, out: Path, started: float, budget_s: float, meta: dict):
    """A TrainerCallback-shaped object: one record a step, appended to the records file (`records_path`), the run
    stopped at the budget. Everything but the step's clock is read after the clock stops, and the append is
    one line: the work between two steps is the same at step 10 as at step 10,000."""
    cuda = meta["device"] == "cuda"

    clocks = ClockSampler() if cuda else None
    lines = open_records(out, meta)

    class Recorder:
        last = None
        write_s = None

        def on_train_end(self, args, state, control, **kwargs):
            if clocks is not None:
                clocks.stop()
            lines.close()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            engine = getattr(trainer_box.get("trainer"), "sampler", None)
            logged = state.log_history[-1] if state.log_history else {}
            phases = {k[5:]: round(v, 4) for k, v in logged.items() if k.startswith("time/") and isinstance(v, float)}
            card = clocks.since(self.last) if clocks is not None and self.last is not None else {}
            record = dict(
                step=state.global_step, seconds=None if self.last is None else round(now - self.last, 4),
                trainer_step_s=round(logged["step_time"], 4) if isinstance(logged.get("step_time"), float) else None,
                allocated_mib=torch.cuda.memory_allocated() / 2**20 if cuda else None,
                reserved_mib=torch.cuda.memory_reserved() / 2**20 if cuda else None,
                rss_mib=rss_mib(), compiled_graphs=compiled_graphs(),
                graph_captures=getattr(getattr(engine, "graphs", None), "captures", None),
                phases=phases, sm_clock_mhz=card.get("sm_clock_mhz"), power_w=card.get("power_w"),
                temperature_c=card.get("temperature_c"), throttle_reasons=card.get("throttle_reasons"),
                gc_collections=[generation["collections"] for generation in gc.get_stats()],
                gc_gen2_objects=len(gc.get_objects(generation=2)) if state.global_step % 50 == 0 else None,
                write_s=self.write_s,
                allocator=allocator_counts() if cuda else None)
            records.append(record)
            lines.write(json.dumps(record) + "\n")
            lines.flush()
            if meta.get("rewrite_json"):  # the bench as it was, for comparison: the whole JSON after every step
                write(out, meta, records)
            self.last = time.perf_counter()
            self.write_s = round(self.last - now, 4)  # the recorder's own time, outside every step's
            if now - started > budget_s:
                control.should_training_stop = True
            return control

    return Recorder()


def records_path(out: Path) -> Path:
    """Where the records go as the run makes them: one JSON line a step after a first line of the run's settings,
    so that a run cut short keeps what it measured (`--summarize` reads it)."""
    return out.with_suffix(".jsonl")


def open_records(out: Path, meta: dict):
    lines = records_path(out).open("w")
    lines.write(json.dumps(meta) + "\n")
    lines.flush()
    return lines


def read_records(path: Path) -> tuple[dict, list]:
    """(the run's settings, its records) from a records file; a last line cut short is left out."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows[0], rows[1:]


def write(out: Path, meta: dict, records: list, summary: dict | None = None) -> None:
    """The run's settings, every record and the summary in one JSON file (at the end of the run)."""
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps({**meta, "records": records, "summary": summary}, indent=1))
    partial.replace(out)


def relative(a, b):
    if a is None or b is None or a != a or b != b or a == 0:
        return None
    return (b - a) / a


def summarize(records: list, warmup: int, device: str) -> dict:
    """Step `warmup` against the last step; mean step time of steps warmup+1..2·warmup against the last
    `warmup` steps."""
    by_step = {r["step"]: r for r in records}
    last = records[-1]
    first = by_step.get(warmup)
    if first is None or last["step"] < 2 * warmup + 1:
        return {"error": f"too few steps ({last['step']}) for a warm-up of {warmup} and two windows of it"}
    early = [by_step[s]["seconds"] for s in range(warmup + 1, 2 * warmup + 1) if by_step.get(s, {}).get("seconds")]
    late = [r["seconds"] for r in records[-warmup:] if r["seconds"]]
    memory_keys = ("allocated_mib", "reserved_mib") if device == "cuda" else ("rss_mib",)
    rows = {}
    for key in ("allocated_mib", "reserved_mib", "rss_mib"):
        change = relative(first[key], last[key])
        rows[key] = dict(at_warmup=first[key], last=last[key], change=change,
                         verdict=None if key not in memory_keys else
                         ("PASS" if change is not None and abs(change) <= LIMITS["memory"] else "FAIL"))
    compiled = last["compiled_graphs"] - first["compiled_graphs"]
    captures = (last["graph_captures"] or 0) - (first["graph_captures"] or 0)
    rows["recompilations"] = dict(at_warmup=first["compiled_graphs"], last=last["compiled_graphs"],
                                  change=compiled, verdict="PASS" if compiled == 0 else "FAIL")
    rows["graph_captures"] = dict(at_warmup=first["graph_captures"], last=last["graph_captures"], change=captures,
                                  verdict="PASS" if captures == 0 else "FAIL")
    early_mean, late_mean = sum(early) / len(early), sum(late) / len(late)
    change = relative(early_mean, late_mean)
    rows["step_seconds"] = dict(at_warmup=early_mean, last=late_mean, change=change,
                                verdict="PASS" if change is not None and change <= LIMITS["time"] else "FAIL")
    # How much the step time moves by itself: the means of consecutive warm-up-long windows, and the
    # least-squares trend over every step after warm-up (as a change from the first to the last of them).
    timed = [(r["step"], r["seconds"]) for r in records if r["step"] > warmup and r["seconds"]]
    windows = [sum(t for _, t in timed[i:i + warmup]) / len(timed[i:i + warmup]) for i in range(0, len(timed), warmup)
               if len(timed[i:i + warmup]) == warmup]
    n, mean_step = len(timed), sum(s for s, _ in timed) / len(timed)
    mean_t = sum(t for _, t in timed) / n
    slope = (sum((s - mean_step) * (t - mean_t) for s, t in timed)
             / max(sum((s - mean_step) ** 2 for s, _ in timed), 1e-12))
    noise = dict(window_means=[round(w, 4) for w in windows],
                 window_spread=(max(windows) - min(windows)) / min(windows) if windows else None,
                 trend=slope * (timed[-1][0] - timed[0][0]) / mean_t if n > 1 else None)
    # Where a change in step time comes from: each phase's mean, the time outside the phases and outside the
    # trainer's own step, the collector's full collections, the allocator's blocks, and the card's clock, power
    # and temperature, in the same two windows.
    early_records = [by_step[s] for s in range(warmup + 1, 2 * warmup + 1) if s in by_step]
    late_records = records[-warmup:]

    def window_mean(window, read):
        values = [v for v in map(read, window) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return sum(values) / len(values) if values else None

    def outside_phases(r):
        timed = [v for k, v in (r.get("phases") or {}).items() if k != "gc"]  # the collector's time is inside them
        return r["seconds"] - sum(timed) if r.get("seconds") and timed else None

    def outside_step(r):
        return r["seconds"] - r["trainer_step_s"] if r.get("seconds") and r.get("trainer_step_s") else None

    def full_collections(window):  # per step, from the cumulative counts
        counts = [r["gc_collections"][2] for r in window if r.get("gc_collections")]
        return (counts[-1] - counts[0]) / (len(counts) - 1) if len(counts) > 1 else None

    phase_names = sorted({k for r in late_records for k in (r.get("phases") or {})})
    causes = {f"time/{k}": (window_mean(early_records, lambda r: (r.get("phases") or {}).get(k)),
                            window_mean(late_records, lambda r: (r.get("phases") or {}).get(k))) for k in phase_names}
    causes["outside phases"] = (window_mean(early_records, outside_phases), window_mean(late_records, outside_phases))
    causes["outside trainer step"] = (window_mean(early_records, outside_step), window_mean(late_records, outside_step))
    causes["gc gen2 per step"] = (full_collections(early_records), full_collections(late_records))
    for key in ("segments", "inactive_split_blocks", "device_allocs"):
        causes[f"allocator {key}"] = tuple(window_mean(w, lambda r: (r.get("allocator") or {}).get(key))
                                           for w in (early_records, late_records))
    for key in ("sm_clock_mhz", "power_w", "temperature_c"):
        causes[key] = (window_mean(early_records, lambda r: r.get(key)), window_mean(late_records, lambda r: r.get(key)))
    causes = {k: dict(early=a, late=b, change=relative(a, b)) for k, (a, b) in causes.items()
              if a is not None and b is not None}
    throttled = sorted({r["throttle_reasons"] for r in late_records if r.get("throttle_reasons") not in (None, "0x0")})
    verdicts = [r["verdict"] for r in rows.values() if r["verdict"]]
    return {"warmup": warmup, "steps": last["step"], "rows": rows, "step_time_noise": noise, "causes": causes,
            "throttle_reasons_late": throttled, "verdict": "PASS" if all(v == "PASS" for v in verdicts) else "FAIL"}


def table(summary: dict) -> str:
    if "error" in summary:
        return summary["error"]
    w = summary["warmup"]
    names = {"allocated_mib": "CUDA allocated (MiB)", "reserved_mib": "CUDA reserved (MiB)", "rss_mib": "RSS (MiB)",
             "recompilations": "compiled graphs", "graph_captures": "engine graph captures",
             "step_seconds": "step seconds (mean)"}
    lines = [f"{'':24} {'step ' + str(w):>14} {'last':>14} {'change':>10}  verdict",
             f"(step time: the mean of steps {w + 1}-{2 * w} against that of the last {w})"]
    for key, row in summary["rows"].items():
        def cell(value):
            return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
        change = row["change"]
        shown = "-" if change is None else f"{change:+.2%}" if key not in ("recompilations", "graph_captures") \
            else f"{change:+d}"
        lines.append(f"{names[key]:24} {cell(row['at_warmup']):>14} {cell(row['last']):>14} {shown:>10}  "
                     f"{row['verdict'] or '(info)'}")
    noise = summary["step_time_noise"]
    if noise["window_spread"] is not None:
        lines.append(f"step time of {w}-step windows after warm-up: {min(noise['window_means']):.3f}-"
                     f"{max(noise['window_means']):.3f} s (spread {noise['window_spread']:.1%}); least-squares "
                     f"trend over the run {noise['trend']:+.1%}: a change within the spread is noise, not drift")
    for key, cause in summary.get("causes", {}).items():
        change = "-" if cause["change"] is None else f"{cause['change']:+.2%}"
        lines.append(f"  {key:22} {cause['early']:>14.4f} {cause['late']:>14.4f} {change:>10}  (cause)")
    if summary.get("throttle_reasons_late"):
        lines.append(f"  the card's clock was held down in the last {w} steps (nvidia-smi "
                     f"clocks_throttle_reasons.active: {', '.join(summary['throttle_reasons_late'])})")
    lines.append(f"{summary['steps']} steps: {summary['verdict']} (memory within {LIMITS['memory']:.0%}, no "
                 f"recompilation after step {w}, step time within {LIMITS['time']:.0%})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5000, help="at most this many (the time budget ends it first)")
    parser.add_argument("--time-budget", type=float, default=500.0, help="seconds from the start, set-up included")
    parser.add_argument("--warmup", type=int, default=50, help="steps before the first measurement")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and batches (a CPU check of the script)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "soak.json"))
    parser.add_argument("--rewrite-json", action="store_true",
                        help="also rewrite the whole JSON after every step, outside the timed steps, as the bench did "
                             "before (a pause between steps that grows with them): to compare a run with it")
    parser.add_argument("--summarize", metavar="RECORDS", help="only summarize a records file (soak.jsonl) of a run "
                                                               "cut short; writes --out and prints the table")
    args = parser.parse_args(argv)
    if args.summarize:
        meta, records = read_records(Path(args.summarize))
        summary = summarize(records, meta["warmup"], meta["device"])
        write(Path(args.out), meta, records, summary)
        print(table(summary))
        return 0 if summary.get("verdict") == "PASS" else 1
    started = time.perf_counter()
    warmup = min(args.warmup, max(1, (args.steps - 1) // 3))  # room for two windows after it
    shape, run = (SMOKE if args.tiny else SHAPES)["0.5b"], TINY_RUN if args.tiny else RUN
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=args.device, device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                torch=torch.__version__, shape=shape, run=run, warmup=warmup, limits=LIMITS,
                rewrite_json=args.rewrite_json)

    from cohort_grpo import GRPOConfig

    vocab = shape["vocab_size"]
    output_dir = tempfile.mkdtemp(prefix="cohort-soak-")
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=run["per_device"], gradient_accumulation_steps=run[
            "grad_accum"], num_generations=run["generations"], max_prompt_length=run["prompt_len"],
        max_completion_length=run["completion_len"], beta=0.04, num_iterations=1, learning_rate=1e-6,
        temperature=1.0, top_k=0, top_p=1.0, dtype="auto", max_steps=args.steps, eval_steps=0, save_steps=0,
        log_completions_steps=10**6, report_to="none", seed=0, device=args.device)
    records: list = []
    box: dict = {}

    SoakTrainer = unsaved_trainer()
    recorder = step_recorder(box, records, out, started, args.time_budget, meta)
    rows = make_prompts(vocab, max(64, run["prompts"] * 4), run["prompt_len"])
    box["trainer"] = SoakTrainer(model=build_module(shape, args.device),
                                 reward_funcs=[make_reward(run["completion_len"])],
                                 train_dataset=rows, args=config, processing_class=make_tokenizer(vocab),
                                 callbacks=[recorder], log=lambda *_: None)
    meta["torch_compile"] = box["trainer"].args.torch_compile
    box["trainer"].train()
    shutil.rmtree(output_dir, ignore_errors=True)
    summary = summarize(records, warmup, args.device)
    write(out, meta, records, summary)
    print(table(summary))
    print(f"wrote {out}")
    return 0 if summary.get("verdict") == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
