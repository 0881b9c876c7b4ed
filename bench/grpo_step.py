"""The whole GRPO step, cohort against TRL 1.16's GRPOTrainer, on one GPU in one call (issue 5).

For each model shape (random-init Qwen2.5-0.5B and -1.5B, bf16 safetensors, the synthetic word-level
tokenizer of ../shared/bench/trl_baseline.py) both trainers run the same configuration: 32 prompts
× 8 generations, 128-token prompts, 512-token completions (random weights never emit EOS), β = 0.04,
μ = 1, lr 1e-6, temperature 1, per-device batch 32 × 8 accumulation, reward = fraction of distinct
words. Each run is its own process (bench/grpo_step_worker.py), so its peak CUDA memory is its own.
Reported: seconds per step (steady state = mean of the steps after the first), peak
torch.cuda.max_memory_allocated, the speed-up TRL/cohort, and cohort's per-phase times, tokens/s and
update MFU. Extra parts: a Qwen2.5-7B-shaped model trained with LoRA (--lora-7b) and the largest
Qwen2.5 shape that trains with full parameters (--max-full-param 3b,7b).

    python bench/grpo_step.py --lora-7b --max-full-param 3b   # the device run (command printed at the top)
    python bench/grpo_step.py --smoke                         # tiny shapes on the CPU: checks the script

A vision-language step: `--models qwen2.5-vl-3b`, a random Qwen2.5-VL-3B shape (bench/grpo_step_vision.py), the
same batch with one 448 × 448 synthetic image per prompt (256 image tokens before the 128 words), both trainers
given the processor as processing_class (TRL's VLM path: an `image` column, conversational prompts; TRL's weights
bf16, as its float32 default does not fit one 80 GB card at this size; both train the vision tower too, TRL's
default; `--cohort-variants freeze_vision_tower=true` adds cohort's default). It needs Pillow on the device:

    python bench/grpo_step.py --models qwen2.5-vl-3b --trl-steps 2 --cohort-steps 4   # the device run (VISION_CALL)
    python bench/grpo_step.py --smoke --models qwen2.5-vl-3b --trl-steps 0             # the CPU check

One card at 8B (Llama-3.1-8B shape): full parameters with 4,096-token completions and cohort's defaults (the memory
plan keeps AdamW's state in host memory where it must: `offload_optimizer=auto`), and LoRA against TRL + PEFT:

    python bench/grpo_step.py --models none --full-param-8b --full-param-8b-steps 2
    python bench/grpo_step.py --models none --lora-8b --lora-steps 3 --lora-8b-trl-steps 2

Default steps aim at one 10-minute device call (--time-budget 560 s): TRL 3 steps for 0.5B, 2 for 1.5B
(the first step is warm-up, about 40 s for 0.5B on an H200), cohort 5, LoRA 3, probes 2.

Writes $OUT/grpo_step.json and $OUT/grpo_step.md when OUT is set (after every part, so a run cut
short keeps what it measured). --time-budget skips the parts that no longer fit, saying so. Back on the
checkout, `python bench/grpo_step_report.py grpo_step.json --write-docs` puts the rows in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the worker's shapes and the report beside this file
from grpo_step_report import comparison_text, fmt, lora_text, markdown, summarize, unfinished_flags  # noqa: E402

WORKER = Path(__file__).resolve().with_name("grpo_step_worker.py")
DEVICE_COMMAND = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit; "
    "python3 bench/grpo_step.py --models 0.5b,1.5b --lora-7b --max-full-param 3b")
DEVICE_CALL = f'device run, carry [".whl"], timeout_s 600, command: {DEVICE_COMMAND}   (OUT is set by the tool)'
VISION_CALL = DEVICE_CALL.replace("--models 0.5b,1.5b --lora-7b --max-full-param 3b",
                                  "--models qwen2.5-vl-3b --trl-steps 2 --cohort-steps 4")
VISION_SHAPES = ("qwen2.5-vl-3b",)  # compared under their own name (bench/grpo_step_vision.py runs them)
# Batches: the comparison is issue 5's configuration; LoRA and the full-parameter probe use small ones.
RUNS = {
    "compare": dict(prompts=32, generations=8, prompt_len=128, completion_len=512, per_device=32, grad_accum=8),
    "lora": dict(prompts=8, generations=8, prompt_len=128, completion_len=256, per_device=16, grad_accum=4),
    "probe": dict(prompts=4, generations=8, prompt_len=128, completion_len=256, per_device=8, grad_accum=4),
    # full parameters of an 8B shape on one card: 4 prompts × 8 completions of 4,096 tokens
    "long": dict(prompts=4, generations=8, prompt_len=128, completion_len=4096, per_device=8, grad_accum=4),
    # LoRA at the 8B shape, cohort against TRL + PEFT: completions TRL's generate finishes in a call
    "lora8b": dict(prompts=4, generations=8, prompt_len=128, completion_len=1024, per_device=8, grad_accum=4),
}
SMOKE_RUNS = {
    "compare": dict(prompts=4, generations=4, prompt_len=16, completion_len=16, per_device=4, grad_accum=4),
    "lora": dict(prompts=2, generations=4, prompt_len=16, completion_len=16, per_device=4, grad_accum=2),
    "probe": dict(prompts=2, generations=4, prompt_len=16, completion_len=16, per_device=4, grad_accum=2),
    "long": dict(prompts=2, generations=4, prompt_len=16, completion_len=32, per_device=4, grad_accum=2),
    "lora8b": dict(prompts=2, generations=4, prompt_len=16, completion_len=16, per_device=4, grad_accum=2),
}
SHAPE_NAMES = ("0.5b", "1.5b", "3b", "7b", "qwen3-moe-1b-7b", "qwen3-30b-a3b-half", *VISION_SHAPES)
TRL_MODULES = ("trl", "datasets", "dill", "multiprocess", "accelerate", "pandas", "pyarrow", "xxhash", "psutil",
               "jinja2", "yaml")  # TRL 1.16 and datasets 5.2 Requires-Dist, as import names
VISION_MODULES = ("PIL",)  # the images and the image processor, both trainers
MIN_START_SECONDS = 20  # a part that cannot get this long is skipped, not started


class Budget:
    def __init__(self, seconds: float):
        self.started, self.limit = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.limit - self.elapsed()


class Bench:
    """Runs the parts in order, each worker in a subprocess, and keeps the results on disk."""

    def __init__(self, args):
        self.args = args
        self.runs = dict(SMOKE_RUNS if args.smoke else RUNS)
        other = {k: getattr(args, k) for k in ("prompt_len", "completion_len", "prompts", "generations", "per_device",
                                               "grad_accum") if getattr(args, k)}
        if other:  # another shape of the comparison (not the issue's), e.g. long completions
            self.runs["compare"] = {**self.runs["compare"], **other}
        self.device = "cpu" if args.smoke else "cuda"
        self.budget = Budget(args.time_budget)
        self.scratch = Path(tempfile.mkdtemp(prefix="grpo-step-"))
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
        self.results: dict = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=None,
                                  device_call=DEVICE_CALL, argv=sys.argv[1:], smoke=args.smoke, notes=[],
                                  comparisons={}, lora_7b=None, max_full_param=None, batch=self.runs["compare"],
                                  options=dict(gradient_checkpointing=args.gradient_checkpointing,
                                               max_tokens_per_micro_batch=args.micro_batch_tokens))

    # ---- infrastructure --------------------------------------------------------------------------
    def note(self, text: str) -> None:
        print(f"NOTE: {text}", flush=True)
        self.results["notes"].append(text)

    def spec(self, kind: str, label: str, shape_name: str, run: str, steps: int, **extra) -> dict:
        from grpo_step_worker import SHAPES, SMOKE  # the shapes live beside the code that builds them

        shape = (SMOKE if self.args.smoke else SHAPES)[shape_name]
        batch = dict(self.runs[run], steps=steps)
        batch["rows"] = batch["prompts"] * 8  # trl_baseline.py's dataset: 32 prompts × 8 steps' worth
        extra.setdefault("cohort_options", dict(self.args.cohort_options))
        return dict(kind=kind, label=label, shape=shape, run=batch, device=self.device,
                    gradient_checkpointing={"on": True, "off": False}.get(self.args.gradient_checkpointing),
                    micro_batch_tokens=self.args.micro_batch_tokens, **extra)

    def worker(self, spec: dict) -> dict:
        """Run one worker with the time left; stream its output; return its (possibly partial) result."""
        label = spec["label"]
        remaining = self.budget.remaining()
        if remaining < MIN_START_SECONDS:
            self.note(f"{label} skipped: {remaining:.0f} s of the {self.args.time_budget:.0f} s budget left")
            return dict(status="skipped", label=label)
        spec_path, result_path = self.scratch / f"{label}.spec.json", self.scratch / f"{label}.result.json"
        spec_path.write_text(json.dumps(spec))
        result_path.unlink(missing_ok=True)
        print(f"\n== {label}: start at {self.budget.elapsed():.0f} s (limit {remaining:.0f} s)", flush=True)
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(WORKER), str(spec_path), str(result_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"})
        tail: deque[str] = deque(maxlen=25)

        def echo() -> None:
            for line in proc.stdout:
                tail.append(line.rstrip())
                print(f"  [{label}] {line.rstrip()}", flush=True)

        reader = threading.Thread(target=echo, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and anything it started
            proc.wait()
        reader.join(timeout=5)
        result = json.loads(result_path.read_text()) if result_path.is_file() else dict(status="running", notes=[])
        if timed_out:
            result["status"] = "timeout"
            self.note(f"{label} stopped by the time budget after {time.perf_counter() - started:.0f} s; "
                      "its finished steps are kept")
        elif result.get("status") == "running":
            result.update(status="crashed", exit_code=proc.returncode)
        if result["status"] in ("crashed", "error"):
            result["output_tail"] = list(tail)
        result["wall_seconds"] = round(time.perf_counter() - started, 1)
        self.results["device"] = self.results["device"] or result.get("device")
        for package in ("torch", "transformers", "trl"):  # versions, as the workers saw them
            if not self.results.get(package) and result.get(package):
                self.results[package] = result[package]
        print(f"== {label}: {result['status']} in {result['wall_seconds']:.0f} s "
              f"(elapsed {self.budget.elapsed():.0f} of {self.args.time_budget:.0f} s)", flush=True)
        return result

    def save(self) -> None:
        self.results["elapsed_seconds"] = round(self.budget.elapsed(), 1)
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "grpo_step.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "grpo_step.md").write_text(markdown(self.results) + "\n")

    # ---- the parts -----------------------------------------------------------------------------------
    def compare(self, name: str, trl_steps: int, trl_available: bool) -> None:
        """Build the folder, then cohort and TRL on it (cohort first: if time runs out, the
        measurement of the new code is the one that must exist; TRL's has a published baseline)."""
        label = name if name in VISION_SHAPES else f"qwen2.5-{name}"
        entry: dict = self.results["comparisons"].setdefault(label, {"model": name})
        if name in VISION_SHAPES:
            from grpo_step_vision import image_tokens  # beside this file, as the worker's shapes
            from grpo_step_worker import SHAPES, SMOKE

            shape = (SMOKE if self.args.smoke else SHAPES)[name]
            self.note(f"{label}: each prompt also holds one {shape['image_side']} x {shape['image_side']} image "
                      f"({image_tokens(shape)} image tokens and 2 tags before its words)")
        folder = self.scratch / f"{label}-random"
        entry["build"] = self.worker(self.spec("build", f"build-{name}", name, "compare", 0, folder=str(folder)))
        if entry["build"].get("status") == "ok":
            entry["cohort"] = self.worker(self.spec("cohort", f"cohort-{name}", name, "compare", self.args.cohort_steps,
                                                    folder=str(folder), source="folder"))
            self.save()
            every_model = self.args.variants_on_every_model or name == self.args.models[0]
            for index, variant in enumerate(self.args.cohort_variants if every_model else []):
                options = {**self.args.cohort_options, **variant}
                vlabel = f"cohort-{name}-v{index + 1}"
                result = self.worker(self.spec("cohort", vlabel, name, "compare", self.args.cohort_steps,
                                               folder=str(folder), source="folder", cohort_options=options))
                result["options"] = options
                entry.setdefault("variants", {})[vlabel] = result
                steady = result.get("steady") or {}
                print(f"{vlabel} {options}: {fmt(result.get('steady_seconds'), '.2f')} s/step, peak "
                      f"{fmt(result.get('peak_gib'), '.1f')} GiB, mfu {fmt(steady.get('mfu'), '.3f')}, "
                      f"update {fmt(steady.get('time/update'), '.2f')} s, sampling "
                      f"{fmt(steady.get('tokens_per_second/sampling'), '.0f')} tok/s, max |Δ log p| per step "
                      f"{result.get('sampling_logp_difference_max')} (default run: "
                      f"{(entry.get('cohort') or {}).get('sampling_logp_difference_max')})", flush=True)
                self.save()
            if not trl_available:
                entry["trl"] = dict(status="skipped", reason="trl or datasets not importable")
            elif trl_steps <= 0:
                entry["trl"] = dict(status="skipped", reason="--trl-steps 0")
            else:
                entry["trl"] = self.worker(self.spec("trl", f"trl-{name}", name, "compare", trl_steps,
                                                     folder=str(folder)))
        shutil.rmtree(folder, ignore_errors=True)
        entry["summary"] = summarize(entry)
        print("\n" + comparison_text(label, entry, self.runs["compare"]) + "\n", flush=True)
        self.save()

    def lora_7b(self) -> None:
        if importlib.util.find_spec("peft") is None:
            self.results["lora_7b"] = dict(status="skipped", reason="peft not importable")
            self.note("LoRA part skipped: peft is not importable (pip install --no-deps peft)")
            return
        lora = dict(r=self.args.lora_r, alpha=2 * self.args.lora_r)
        result = self.worker(self.spec("cohort", "lora-7b", "7b", "lora", self.args.lora_steps, source="module",
                                       lora=lora))
        result["batch"] = self.runs["lora"]
        self.results["lora_7b"] = result
        print("\n" + lora_text(result) + "\n", flush=True)
        self.save()

    def full_param_8b(self) -> None:
        """Full-parameter GRPO of the Llama-3.1-8B shape with 4K-token completions on one card, cohort's defaults (the
        memory plan decides where AdamW's state lives: `offload_optimizer=auto`)."""
        result = self.worker(self.spec("cohort", "full-8b", "llama3.1-8b", "long",
                                       self.args.full_param_8b_steps, source="module"))
        result["batch"] = self.runs["long"]
        self.results["full_param_8b"] = result
        steady = result.get("steady") or {}
        print(f"\nfull-parameter Llama-3.1-8B shape, {self.runs['long']}: {result.get('status')}; step "
              f"{fmt(result.get('steady_seconds'), '.1f')} s, sampling {fmt(steady.get('time/sampling'), '.1f')} s, "
              f"update {fmt(steady.get('time/update'), '.1f')} s, peak {fmt(result.get('peak_gib'), '.1f')} GiB; "
              f"{result.get('optimizer_line')}\n", flush=True)
        self.save()

    def lora_8b(self, trl_steps: int, trl_available: bool) -> None:
        """LoRA (r 16 on every projection) at the Llama-3.1-8B shape: cohort, then TRL 1.16 + PEFT on the same folder
        and batch."""
        lora = dict(r=self.args.lora_r, alpha=2 * self.args.lora_r)
        entry: dict = {"batch": self.runs["lora8b"], "lora": lora}
        self.results["lora_8b"] = entry
        folder = self.scratch / "llama3.1-8b-random"
        entry["build"] = self.worker(self.spec("build", "build-8b", "llama3.1-8b", "lora8b", 0, folder=str(folder)))
        if entry["build"].get("status") == "ok":
            entry["cohort"] = self.worker(self.spec("cohort", "cohort-lora-8b", "llama3.1-8b", "lora8b",
                                                    self.args.lora_steps, folder=str(folder), source="folder",
                                                    lora=lora))
            self.save()
            if not trl_available or importlib.util.find_spec("peft") is None:
                entry["trl"] = dict(status="skipped", reason="trl, datasets or peft not importable")
            else:
                entry["trl"] = self.worker(self.spec("trl", "trl-lora-8b", "llama3.1-8b", "lora8b", trl_steps,
                                                     folder=str(folder), lora=lora))
        shutil.rmtree(folder, ignore_errors=True)
        cohort, trl = (entry.get(k) or {} for k in ("cohort", "trl"))
        speedup = (trl["steady_seconds"] / cohort["steady_seconds"]
                   if trl.get("steady_seconds") and cohort.get("steady_seconds") else None)
        entry["speedup"] = speedup
        print(f"\nLoRA at the Llama-3.1-8B shape, {self.runs['lora8b']}: cohort {fmt(cohort.get('steady_seconds'), '.1f')}"
              f" s/step (peak {fmt(cohort.get('peak_gib'), '.1f')} GiB), TRL + PEFT "
              f"{fmt(trl.get('steady_seconds'), '.1f')} s/step (peak {fmt(trl.get('peak_gib'), '.1f')} GiB): "
              f"{fmt(speedup, '.2f')}x\n", flush=True)
        self.save()

    def max_full_param(self, sizes: list[str]) -> None:
        """Shapes in the order given; the first that does not fit ends the search."""
        probes: dict = {}
        self.results["max_full_param"] = dict(probes=probes, largest_fitting=None, batch=self.runs["probe"])
        for name in sizes:
            result = self.worker(self.spec("cohort", f"full-{name}", name, "probe", 2, source="module"))
            fits = result.get("status") == "ok"
            result["fits"] = fits if result.get("status") in ("ok", "oom") else None
            probes[name] = result
            if fits:
                self.results["max_full_param"]["largest_fitting"] = name
            print(f"full-parameter {name}: {'fits' if fits else result.get('status')}, peak "
                  f"{fmt(result.get('peak_gib'), '.1f')} GiB", flush=True)
            self.save()
            if not fits:
                break
        print(f"largest full-parameter Qwen2.5 shape that trains on this card, of {','.join(sizes)}: "
              f"{self.results['max_full_param']['largest_fitting'] or 'none'}", flush=True)


# ---- command line ----------------------------------------------------------------------------------------

def _options(text: str) -> dict:
    """'a=1,b=true,c=x' -> {'a': 1, 'b': True, 'c': 'x'} (JSON values where they parse)."""
    out = {}
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = json.loads(value.strip())
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None,
                        help="comma list of 0.5b, 1.5b, qwen3-moe-1b-7b, qwen3-30b-a3b-half, qwen2.5-vl-3b (a "
                             "vision-language step: one 448 x 448 image per prompt) (default 0.5b,1.5b; "
                             "--smoke: 0.5b; none: only the extras)")
    parser.add_argument("--trl-steps", default="3,2",
                        help="TRL steps, one number or one per --models entry in order (0 = skip TRL); default 3 for 0.5B, 2 for 1.5B "
                             "(its first step is warm-up: 2 steps give one steady-state step) to fit the 9-minute call")
    parser.add_argument("--cohort-steps", type=int, default=5)
    parser.add_argument("--gradient-checkpointing", choices=("default", "on", "off"), default="default",
                        help="cohort's GRPOConfig.gradient_checkpointing (default: cohort's default, auto; TRL "
                             "always on, as its baseline)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="cohort's GRPOConfig.max_tokens_per_micro_batch, where that field exists")
    parser.add_argument("--cohort-options", default="",
                        help="extra GRPOConfig fields for every cohort run, e.g. torch_compile=true,max_tokens_per_micro_batch=8192")
    parser.add_argument("--cohort-variants", default="",
                        help="';'-separated option sets, each one more cohort run on the first model, e.g. "
                             "'gradient_checkpointing=false,max_tokens_per_micro_batch=4096;torch_compile=false'")
    parser.add_argument("--variants-on-every-model", action="store_true",
                        help="run the --cohort-variants on every model of --models, not only the first "
                             "(e.g. rollout_numerics=exact beside the default at 0.5B and 1.5B)")
    parser.add_argument("--prompt-len", type=int, default=0,
                        help="prompt tokens of the comparison (default the issue's 128), e.g. 256 for GSM8K-like proportions")
    parser.add_argument("--completion-len", type=int, default=0,
                        help="completion tokens of the comparison (default the issue's 512)")
    parser.add_argument("--prompts", type=int, default=0, help="prompts per step of the comparison (default 32)")
    parser.add_argument("--generations", type=int, default=0, help="completions per prompt (default 8)")
    parser.add_argument("--per-device", type=int, default=0,
                        help="per-device batch of both trainers (default 32); × --grad-accum = prompts × generations")
    parser.add_argument("--grad-accum", type=int, default=0, help="gradient accumulation steps (default 8)")
    parser.add_argument("--lora-7b", action="store_true", help="then train a Qwen2.5-7B shape with LoRA")
    parser.add_argument("--lora-steps", type=int, default=3)
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2r)")
    parser.add_argument("--max-full-param", default="", help="then probe full-parameter shapes, e.g. 3b,7b")
    parser.add_argument("--full-param-8b", action="store_true",
                        help="then train the Llama-3.1-8B shape with full parameters, 4K-token completions, defaults")
    parser.add_argument("--full-param-8b-steps", type=int, default=3)
    parser.add_argument("--lora-8b", action="store_true",
                        help="then LoRA at the Llama-3.1-8B shape, cohort against TRL + PEFT (1,024-token completions)")
    parser.add_argument("--lora-8b-trl-steps", type=int, default=2)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole run; parts that no longer fit are skipped (default 560, smoke 3600)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of this script: tiny shapes, TRL and cohort 2 steps, LoRA and full-param probes")
    args = parser.parse_args(argv)
    args.models = args.models or ("0.5b" if args.smoke else "0.5b,1.5b")
    args.models = [] if args.models.strip().lower() == "none" else [m.strip().lower() for m in args.models.split(",")
                                                                     if m.strip()]
    args.max_full_param = [m.strip().lower() for m in args.max_full_param.split(",") if m.strip()]
    args.cohort_options = _options(args.cohort_options)
    args.cohort_variants = [_options(v) for v in args.cohort_variants.split(";") if v.strip()]
    for name in args.models + args.max_full_param:
        if name not in SHAPE_NAMES:
            parser.error(f"unknown model shape {name!r}; choose from {', '.join(SHAPE_NAMES)}")
    if args.smoke:
        args.trl_steps = "2" if args.trl_steps == parser.get_default("trl_steps") else args.trl_steps
        args.cohort_steps = min(args.cohort_steps, 2)
        args.lora_steps = min(args.lora_steps, 2)
        args.lora_7b = True
        args.max_full_param = args.max_full_param or ["3b", "7b"]
    steps = [int(s) for s in str(args.trl_steps).split(",") if s.strip()]
    args.trl_steps = [steps[min(i, len(steps) - 1)] for i in range(len(args.models))] if steps else []
    if args.time_budget is None:
        args.time_budget = 3600.0 if args.smoke else 560.0  # + pip install: inside the 600 s of one call
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    vision = any(name in VISION_SHAPES for name in args.models)
    print(f"Run on the device with:\n  {VISION_CALL if vision else DEVICE_CALL}\n", flush=True)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():  # no CUDA context is created by this check
            sys.exit("bench/grpo_step.py needs a CUDA GPU; use --smoke to check the script on a CPU")
    bench = Bench(args)
    missing = [m for m in TRL_MODULES if importlib.util.find_spec(m) is None]
    trl_available = "trl" not in missing and "datasets" not in missing
    if missing:
        bench.note(f"not importable: {', '.join(missing)}" + ("" if trl_available else " -> TRL runs skipped")
                   + " (carry .whl and install it as in the command above)")
    if vision and any(importlib.util.find_spec(m) is None for m in VISION_MODULES):
        sys.exit("the vision-language shape needs Pillow (import PIL) for its images: pip install pillow")
    print(f"parts: models {args.models or 'none'} (TRL steps {args.trl_steps}, cohort steps {args.cohort_steps}), "
          f"LoRA 7B {'on' if args.lora_7b else 'off'}, full-param probes {args.max_full_param or 'off'}; "
          f"time budget {args.time_budget:.0f} s", flush=True)
    try:
        for name, trl_steps in zip(args.models, args.trl_steps):
            bench.compare(name, trl_steps, trl_available)
        if args.lora_7b:
            bench.lora_7b()
        if args.max_full_param:
            bench.max_full_param(args.max_full_param)
        if args.full_param_8b:
            bench.full_param_8b()
        if args.lora_8b:
            bench.lora_8b(args.lora_8b_trl_steps, trl_available)
    finally:
        bench.save()
        shutil.rmtree(bench.scratch, ignore_errors=True)
    print("\n" + markdown(bench.results), flush=True)
    rerun = unfinished_flags(bench.results, args)
    if rerun:
        print(f"\nNot finished in this call; a second call can run them: python3 bench/grpo_step.py {rerun}", flush=True)
    print(f"\ntotal {bench.budget.elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main()
