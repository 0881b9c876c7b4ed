"""The docs/performance.md row of one async_rollouts.json (what bench/async_rollouts.py wrote to $OUT).

    python bench/async_rollouts_report.py async_rollouts.json               # print the row
    python bench/async_rollouts_report.py async_rollouts.json --write-docs  # ... and put it on the page
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from performance_page import PAGE, row, write_result  # noqa: E402


def performance_row(report: dict) -> dict:
    """The page's result dict: both modes' means over the measured steps of one call."""
    if report.get("errors"):
        raise SystemExit(f"a mode failed in this call ({report['errors']}): no row from it")
    sync, asynchronous = report["modes"]["sync"]["summary"], report["modes"]["async"]["summary"]
    work, lengths = report["workload"], report["lengths"]
    ranks, samplers = work.get("processes"), work.get("rollout_gpus")
    if ranks is None:  # a report written before the workload named them: the command does
        words = report["command"].split()
        ranks = int(words[words.index("--processes") + 1]) if "--processes" in words else 1
        samplers = int(words[words.index("--rollout_gpus") + 1]) if "--rollout_gpus" in words else 0
    card = report["card"].removeprefix("NVIDIA ").strip() + (f" ×{ranks}" if ranks > 1 else "")  # as grpo_step_report
    layout = (f"{ranks} GPUs: sync DDP over {ranks}, async {samplers} sampling + {ranks - samplers} training"
              if ranks > 1 else "one GPU")
    return dict(kind="async_rollouts", shape=f"Qwen2.5-{report['model'].split()[0].removeprefix('qwen2.5-').upper()} shape",
                card=card, date=report["date"][:10], command=report["command"].replace(" --out /root/out", ""),
                configuration=(f"{layout}; {work['prompts']} prompts × {work['G']}, lengths lognormal median "
                               f"{lengths['median']:.0f} / cap {lengths['cap']} (mean {lengths['mean']:.0f}); "
                               f"max_staleness={work['max_staleness']}"
                               + (", partial rollouts" if work.get("partial_rollouts") else "")),
                sync_tok_per_s=sync["tok_per_s"], async_tok_per_s=asynchronous["tok_per_s"],
                sync_wall_s=sync["wall_s"], async_wall_s=asynchronous["wall_s"],
                sync_sampling_s=sync["time/sampling"], async_wait_s=asynchronous["time/sampling"],
                sync_update_s=sync["time/update"], async_update_s=asynchronous["time/update"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="async_rollouts.json")
    parser.add_argument("--write-docs", action="store_true", help="replace or add the row on docs/performance.md")
    parser.add_argument("--page", default=None, help="another page to write (tests)")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    if report["card"].startswith("cpu"):
        raise SystemExit("a CPU run's numbers (--smoke) mean nothing: docs/performance.md left as it is")
    result = performance_row(report)
    print(row(result))
    if args.write_docs:
        page = args.page or PAGE
        for line in write_result(result, page):
            print(f"dropped from {page} to keep it short: {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
