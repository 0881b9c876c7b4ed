"""Tables of bench/grpo_step.py: the per-model text printed as each part ends, the markdown
written to $OUT/grpo_step.md, and the rows of docs/performance.md. Pure functions of the results
dict (see grpo_step.py), plus a command line that reads a saved one:

    python bench/grpo_step_report.py grpo_step.json               # print its tables again
    python bench/grpo_step_report.py grpo_step.json --write-docs  # and put its rows in docs/performance.md

Only comparisons with TRL's step from the same call become rows (the page shows ratios, never a lone
time); so do the LoRA and full-parameter parts, against the card's memory. A --smoke run is refused.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def summarize(entry: dict) -> dict:
    """One model's comparison: steady s/step of both, TRL/cohort speed-up, peaks, cohort's phases."""
    trl, cohort = entry.get("trl") or {}, entry.get("cohort") or {}
    t, c = trl.get("steady_seconds"), cohort.get("steady_seconds")
    out = dict(trl_seconds=t, cohort_seconds=c, speedup=t / c if t and c else None,
               trl_peak_gib=trl.get("peak_gib"), cohort_peak_gib=cohort.get("peak_gib"))
    if out["trl_peak_gib"] is not None and out["cohort_peak_gib"] is not None:
        out["cohort_memory_not_higher"] = out["cohort_peak_gib"] <= out["trl_peak_gib"]
    steady_phases = cohort.get("steady") or {}
    out.update({k: steady_phases.get(k) for k in ("time/sampling", "time/rewards", "time/logprobs", "time/update",
                                                   "mfu", "tokens_per_second/sampling", "tokens_per_second/update")})
    return out


def fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def first_step(result: dict):
    steps = result.get("step_seconds") or []
    return steps[0] if steps else None


def comparison_text(label: str, entry: dict, run: dict) -> str:
    trl, cohort, s = entry.get("trl") or {}, entry.get("cohort") or {}, entry["summary"]
    head = (f"{label} shape: {run['prompts']} prompts × {run['generations']} generations, {run['prompt_len']}-token "
            f"prompts, {run['completion_len']}-token completions")
    rows = [f"{'':22}{'TRL ' + str(trl.get('trl', '')):>14}{'cohort':>12}",
            f"{'status':22}{trl.get('status', '-'):>14}{cohort.get('status', '-'):>12}",
            f"{'s/step (steady)':22}{fmt(s['trl_seconds'], '.2f'):>14}{fmt(s['cohort_seconds'], '.2f'):>12}",
            f"{'first step s':22}{fmt(first_step(trl), '.1f'):>14}{fmt(first_step(cohort), '.1f'):>12}",
            f"{'peak GiB':22}{fmt(s['trl_peak_gib'], '.1f'):>14}{fmt(s['cohort_peak_gib'], '.1f'):>12}",
            f"speed-up TRL/cohort: {fmt(s['speedup'], '.2f', '×')}",
            "cohort phases (steady s): " + ", ".join(f"{k} {fmt(s['time/' + k], '.2f')}"
                                                     for k in ("sampling", "rewards", "logprobs", "update")),
            f"cohort update MFU {fmt(s['mfu'] and 100 * s['mfu'], '.1f', '%')}, update "
            f"{fmt(s['tokens_per_second/update'], ',.0f')} tok/s, sampling {fmt(s['tokens_per_second/sampling'], ',.0f')} tok/s"]
    rows.append(cohort_details(cohort))
    for who, result in (("TRL", trl), ("cohort", cohort)):
        if result.get("error"):
            rows.append(f"{who} error: {result['error']}")
        rows += [f"{who} note: {n}" for n in result.get("notes", [])]
    return head + "\n" + "\n".join(rows)


def cohort_details(result: dict) -> str:
    """What the cohort run actually used: dtypes, reference copy, checkpointing, micro-batching."""
    micro = ", ".join(f"{k} {v:g}" for k, v in (result.get("micro_batch") or {}).items())
    return (f"cohort: params {result.get('param_dtype')}, optimizer params/moments {result.get('optimizer_param_dtype')}/"
            f"{result.get('optimizer_state_dtype')}, reference copy {result.get('reference_copy')}, gradient "
            f"checkpointing {result.get('gradient_checkpointing')}" + (f", last step: {micro}" if micro else ""))


def lora_text(result: dict) -> str:
    run = result.get("batch", {})
    return (f"LoRA, Qwen2.5-7B shape ({run.get('prompts')} prompts × {run.get('generations')}, "
            f"{run.get('completion_len')} tokens): {result.get('status')}, {fmt(result.get('steady_seconds'), '.2f')} s/step "
            f"steady (first {fmt(first_step(result), '.1f')} s), peak {fmt(result.get('peak_gib'), '.1f')} GiB, "
            f"trainable {fmt(result.get('trainable'), ',')} of {fmt(result.get('parameters'), ',')} parameters, "
            f"route: {result.get('lora_route')}" + (f"\n{cohort_details(result)}" if result.get("param_dtype") else "")
            + (f"\nerror: {result['error']}" if result.get("error") else ""))


def batch_line(results: dict) -> str:
    run, options = results["batch"], results["options"]
    return (f"{run['prompts']} prompts × {run['generations']} generations, {run['prompt_len']}-token prompts, "
            f"{run['completion_len']}-token completions, β = 0.04, μ = 1, per-device batch {run['per_device']} × "
            f"{run['grad_accum']} accumulation; steady state = mean of steps 2..n; cohort options: {options}")


def markdown(results: dict) -> str:
    versions = ", ".join(f"{p} {results[p]}" for p in ("torch", "transformers", "trl") if results.get(p))
    lines = [f"GRPO step, cohort vs TRL: {results.get('device') or 'device unknown'}, {results['date']}; {versions}"
             + (" (CPU smoke run: tiny shapes, numbers mean nothing)" if results["smoke"] else "")]
    if results["comparisons"]:
        lines += ["", batch_line(results), "",
                  "| model | TRL s/step | cohort s/step | speed-up | TRL / cohort first step s | TRL peak GiB | cohort "
                  "peak GiB | cohort sampling / rewards / logprobs / update s | update MFU | update tok/s | sampling tok/s |",
                  "|" + " --- |" * 11]
    for label, entry in results["comparisons"].items():
        s = entry.get("summary") or {}
        if not s:
            continue
        phases = " / ".join(fmt(s.get(f"time/{k}"), ".2f") for k in ("sampling", "rewards", "logprobs", "update"))
        lines.append(f"| {label} | {fmt(s['trl_seconds'], '.2f')} | {fmt(s['cohort_seconds'], '.2f')} | "
                     f"{fmt(s['speedup'], '.2f', '×')} | {fmt(first_step(entry.get('trl') or {}), '.1f')} / "
                     f"{fmt(first_step(entry.get('cohort') or {}), '.1f')} | {fmt(s['trl_peak_gib'], '.1f')} | {fmt(s['cohort_peak_gib'], '.1f')} | "
                     f"{phases} | {fmt(s['mfu'] and 100 * s['mfu'], '.1f', '%')} | "
                     f"{fmt(s['tokens_per_second/update'], ',.0f')} | {fmt(s['tokens_per_second/sampling'], ',.0f')} |")
    lines += [f"\n{label}: {cohort_details(entry['cohort'])}" for label, entry in results["comparisons"].items()
              if (entry.get("cohort") or {}).get("param_dtype")]
    lora = results.get("lora_7b")
    if lora:
        lines += ["", "| LoRA | status | s/step | first step s | peak GiB | trainable / all parameters | route |",
                  "|" + " --- |" * 7,
                  f"| Qwen2.5-7B shape | {lora.get('status')} | {fmt(lora.get('steady_seconds'), '.2f')} | "
                  f"{fmt(first_step(lora), '.1f')} | {fmt(lora.get('peak_gib'), '.1f')} | {fmt(lora.get('trainable'), ',')} / "
                  f"{fmt(lora.get('parameters'), ',')} | {lora.get('lora_route', '-')} |"]
    full = results.get("max_full_param")
    if full:
        run = full["batch"]
        lines += ["", f"Full-parameter probes: 2 steps of {run['prompts']} prompts × {run['generations']}, "
                      f"{run['completion_len']}-token completions, per-device batch {run['per_device']}", "",
                  "| full-parameter shape | result | parameters | s/step | peak GiB | last step micro-batching |",
                  "|" + " --- |" * 6]
        for name, probe in full["probes"].items():
            micro = ", ".join(f"{k} {v:g}" for k, v in (probe.get("micro_batch") or {}).items()) or "-"
            lines.append(f"| Qwen2.5-{name} | {'fits' if probe.get('fits') else probe.get('status')} | "
                         f"{fmt(probe.get('parameters'), ',')} | {fmt(probe.get('steady_seconds'), '.2f')} | "
                         f"{fmt(probe.get('peak_gib'), '.1f')} | {micro} |")
        lines.append(f"\nLargest full-parameter shape that fits, of those tried: {full['largest_fitting'] or 'none'}")
    if results["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines)


def unfinished_flags(results: dict, args) -> str:
    """Command-line flags that repeat only the parts that were skipped or cut short."""
    unfinished = ("skipped", "timeout")
    def model(label: str, entry: dict) -> str:  # the --models name (a vision shape's label is its name)
        return entry.get("model") or label.removeprefix("qwen2.5-")

    compared = {model(label, entry) for label, entry in results["comparisons"].items()}
    models = [model(label, entry) for label, entry in results["comparisons"].items()
              if any((entry.get(k) or {}).get("status") in unfinished for k in ("build", "cohort", "trl"))]
    models += [m for m in args.models if m not in compared]
    flags = [f"--models {','.join(models)}" if models else "--models none"]
    if args.lora_7b and (results.get("lora_7b") or {}).get("status", "skipped") in unfinished:
        flags.append("--lora-7b")
    probes = (results.get("max_full_param") or {}).get("probes", {})
    search_ended = any(p.get("status") in ("oom", "error", "crashed") for p in probes.values())  # larger: not tried
    todo = [] if search_ended else [m for m in args.max_full_param
                                    if (probes.get(m) or {}).get("status", "skipped") in unfinished]
    if todo:
        flags.append(f"--max-full-param {','.join(todo)}")
    return " ".join(flags) if models or len(flags) > 1 else ""


# ---- docs/performance.md ----------------------------------------------------------------------------

COMPARE_BATCH = dict(prompts=32, generations=8, prompt_len=128, completion_len=512)  # the page's stated batch
CARD_GIB = {"H100 80GB HBM3": 81559 / 1024, "H200": 143771 / 1024}  # total memory, as nvidia-smi reports it


def _argv_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def _options_text(options: dict) -> str:
    return ", ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in options.items())


def _cohort_options(results: dict) -> dict:
    """--cohort-options of the call, parsed as grpo_step.py parses them (JSON values where they parse)."""
    out = {}
    for item in (i.strip() for i in (_argv_value(results.get("argv") or [], "--cohort-options") or "").split(",")):
        key, _, value = item.partition("=")
        if key.strip():
            try:
                out[key.strip()] = json.loads(value.strip())
            except json.JSONDecodeError:
                out[key.strip()] = value.strip()
    return out


def _configuration(results: dict, options: dict) -> str:
    """What the row ran, beyond the page's stated set-up: cohort's options and any other batch."""
    parts = [_options_text(options)] if options else []
    run, extra = results.get("batch") or {}, results.get("options") or {}
    if any(run.get(k) != v for k, v in COMPARE_BATCH.items()):
        parts.append(f"{run.get('prompts')} prompts × {run.get('generations')}, "
                     f"{run.get('prompt_len')}-token prompts, {run.get('completion_len')}-token completions")
    if extra.get("gradient_checkpointing") == "off":
        parts.append("gradient checkpointing off")
    if extra.get("max_tokens_per_micro_batch"):
        parts.append(f"max_tokens_per_micro_batch={extra['max_tokens_per_micro_batch']}")
    if not parts and extra.get("gradient_checkpointing") == "on":
        return "gradient_checkpointing=true (as TRL)"
    return "; ".join(parts) or "defaults (torch_compile and gradient_checkpointing auto)"


def _row_base(results: dict, kind: str, shape: str) -> dict:
    return dict(kind=kind, shape=shape, card=(results.get("device") or "unknown card").removeprefix("NVIDIA ").strip(),
                date=str(results.get("date", ""))[:16].replace("T", " "),
                command=" ".join(["python bench/grpo_step.py", *map(shlex.quote, results.get("argv") or [])]))


def performance_rows(results: dict) -> tuple[list[dict], list[str]]:
    """docs/performance.md rows of one grpo_step.json (bench/performance_page.py's result dicts), and
    a line for each part left out."""
    rows, left_out = [], []
    options = _cohort_options(results)
    for label, entry in results.get("comparisons", {}).items():
        shape = f"Qwen2.5-{label.removeprefix('qwen2.5-').upper()} shape"
        trl = entry.get("trl") or {}
        runs = [(options, entry.get("cohort") or {})]
        runs += [(result.get("options") or options, result) for result in (entry.get("variants") or {}).values()]
        for run_options, cohort in runs:
            if not trl.get("steady_seconds") or not cohort.get("steady_seconds"):
                left_out.append(f"{label} {_options_text(run_options) or '(no options)'}: no steady TRL and "
                                f"cohort steps in this call (TRL {trl.get('status', '-')}, "
                                f"cohort {cohort.get('status', '-')})")
                continue
            steady = cohort.get("steady") or {}
            rows.append(dict(_row_base(results, "grpo_step", shape), configuration=_configuration(results, run_options),
                             cohort_seconds=cohort["steady_seconds"], trl_seconds=trl["steady_seconds"],
                             cohort_peak_gib=cohort.get("peak_gib"), trl_peak_gib=trl.get("peak_gib"),
                             mfu=steady.get("mfu"), sampling_seconds=steady.get("time/sampling"),
                             logprobs_seconds=steady.get("time/logprobs"), update_seconds=steady.get("time/update")))
    capacity = []
    lora = results.get("lora_7b") or {}
    if lora.get("steady_seconds"):
        run = lora.get("batch") or {}
        capacity.append(("7B", lora, f"LoRA r={_argv_value(results.get('argv') or [], '--lora-r') or 16}, "
                                     f"{run.get('prompts')} prompts × {run.get('generations')} of "
                                     f"{run.get('completion_len')} tokens"))
    full = results.get("max_full_param") or {}
    for name, probe in (full.get("probes") or {}).items():
        run = full.get("batch") or {}
        if probe.get("fits") and probe.get("steady_seconds"):
            capacity.append((name.upper(), probe, f"full parameters, {run.get('prompts')} prompts × "
                                                  f"{run.get('generations')} of {run.get('completion_len')} tokens"))
    for name, result, what in capacity:
        base = _row_base(results, "capacity", f"Qwen2.5-{name} shape")
        rows.append(dict(base, configuration="; ".join([what] + ([_options_text(options)] if options else [])),
                         peak_gib=result.get("peak_gib"), card_gib=CARD_GIB.get(base["card"]),
                         seconds=result["steady_seconds"]))
    return rows, left_out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Print bench/grpo_step.py's tables from its saved grpo_step.json")
    parser.add_argument("results", help="grpo_step.json, as bench/grpo_step.py writes it to $OUT")
    parser.add_argument("--write-docs", action="store_true",
                        help="also put its rows in docs/performance.md, replacing those of the same shape, card "
                             "and configuration")
    parser.add_argument("--page", default=None, help="the page --write-docs writes (default docs/performance.md)")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    print(markdown(results))
    if not args.write_docs:
        return
    if results.get("smoke"):
        sys.exit("a --smoke run's numbers mean nothing: docs/performance.md left as it is")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from performance_page import PAGE, write_result

    page = args.page or PAGE
    rows, left_out = performance_rows(results)
    for line in left_out:
        print(f"not written: {line}", file=sys.stderr)
    for row in rows:
        for line in write_result(row, page):
            print(f"dropped from {page} to keep it short: {line}", file=sys.stderr)
        print(f"{page}: {row['shape']} on {row['card']}, {row['configuration']}")


if __name__ == "__main__":
    main()
