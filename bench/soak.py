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

The JSON (--out, default $OUT/soak.json or ./soak.json) is rewritten after every step, so a run cut short
keeps what it measured. The model shapes and synthetic inputs are bench/grpo_step_worker.py's.
"""

from __future__ import annotations

import argparse
import json
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
    """nvidia-smi's SM clock (MHz) and power (W), sampled every 200 ms in a child process; `since(t)` gives
    the means since perf_counter time t (None where nvidia-smi is missing)."""

    def __init__(self):
        import subprocess
        import threading

        self.samples: list[tuple[float, float, float]] = []
        try:
            self.process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-i", "0",
                 "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.process = None
            return
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.process.stdout:
            try:
                clock, power = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.perf_counter(), clock, power))

    def since(self, start: float) -> tuple[float | None, float | None]:
        window = [(c, p) for t, c, p in self.samples[-200:] if t >= start]
        if not window:
            return None, None
        return (round(sum(c for c, _ in window) / len(window), 1), round(sum(p for _, p in window) / len(window), 1))

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


def step_recorder(trainer_box: dict, records: list, out: Path, started: float, budget_s: float, meta: dict):
    """A TrainerCallback-shaped object: one record a step, the JSON rewritten, the run stopped at the budget."""
    cuda = meta["device"] == "cuda"

    clocks = ClockSampler() if cuda else None

    class Recorder:
        last = None

        def on_train_end(self, args, state, control, **kwargs):
            if clocks is not None:
                clocks.stop()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            engine = getattr(trainer_box.get("trainer"), "sampler", None)
            logged = state.log_history[-1] if state.log_history else {}
            phases = {k[5:]: round(v, 4) for k, v in logged.items() if k.startswith("time/") and isinstance(v, float)}
            clock, power = clocks.since(self.last) if clocks is not None and self.last is not None else (None, None)
            records.append(dict(
                step=state.global_step, seconds=None if self.last is None else round(now - self.last, 4),
                allocated_mib=torch.cuda.memory_allocated() / 2**20 if cuda else None,
                reserved_mib=torch.cuda.memory_reserved() / 2**20 if cuda else None,
                rss_mib=rss_mib(), compiled_graphs=compiled_graphs(),
                graph_captures=getattr(getattr(engine, "graphs", None), "captures", None),
                phases=phases, sm_clock_mhz=clock, power_w=power))
            write(out, meta, records)
            self.last = time.perf_counter()  # the rewrite grows with the records: no step's time includes it
            if now - started > budget_s:
                control.should_training_stop = True
            return control

    return Recorder()


def write(out: Path, meta: dict, records: list, summary: dict | None = None) -> None:
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
    # Where a change in step time comes from: each phase's mean, and the card's clock, in the same two windows.
    early_records = [by_step[s] for s in range(warmup + 1, 2 * warmup + 1) if s in by_step]
    late_records = records[-warmup:]

    def window_mean(window, read):
        values = [v for v in map(read, window) if isinstance(v, (int, float))]
        return sum(values) / len(values) if values else None

    phase_names = sorted({k for r in late_records for k in (r.get("phases") or {})})
    causes = {f"time/{k}": (window_mean(early_records, lambda r: (r.get("phases") or {}).get(k)),
                            window_mean(late_records, lambda r: (r.get("phases") or {}).get(k))) for k in phase_names}
    for key in ("sm_clock_mhz", "power_w"):
        causes[key] = (window_mean(early_records, lambda r: r.get(key)), window_mean(late_records, lambda r: r.get(key)))
    causes = {k: dict(early=a, late=b, change=relative(a, b)) for k, (a, b) in causes.items() if a is not None}
    verdicts = [r["verdict"] for r in rows.values() if r["verdict"]]
    return {"warmup": warmup, "steps": last["step"], "rows": rows, "step_time_noise": noise, "causes": causes,
            "verdict": "PASS" if all(v == "PASS" for v in verdicts) else "FAIL"}


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
    args = parser.parse_args(argv)
    started = time.perf_counter()
    warmup = min(args.warmup, max(1, (args.steps - 1) // 3))  # room for two windows after it
    shape, run = (SMOKE if args.tiny else SHAPES)["0.5b"], TINY_RUN if args.tiny else RUN
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(device=args.device, device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                torch=torch.__version__, shape=shape, run=run, warmup=warmup, limits=LIMITS)

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
