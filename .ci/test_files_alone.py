#!/usr/bin/env python3
"""Run each tests/test_*.py file on its own, each in a fresh Python process, and fail naming every file that failed.

The whole suite runs in one process, so a test can pass only because another file ran before it (a module
it imported, a setting it left behind). Run alone, that test fails here. The soak tests stay out, as in any
plain `python -m pytest` (pyproject's addopts); CI runs them separately. A failing file does not stop the
others: the end of the output names every file that failed alone, and the exit status is then 1.

    python .ci/test_files_alone.py                    # every tests/test_*.py
    python .ci/test_files_alone.py tests/test_foo.py  # only these files
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTHING_TO_RUN = 5  # pytest's exit status for a file whose tests are all deselected (soak) or none
SHOWN_LINES = 60  # of a failing file's output


def run_alone(path: Path) -> tuple[int, str, float]:
    """(pytest's exit status, its output, seconds) for `path` run alone in a new interpreter."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return done.returncode, done.stdout, time.monotonic() - began


def main(argv: list[str]) -> int:
    files = [Path(name).resolve() for name in argv] or sorted((ROOT / "tests").glob("test_*.py"))
    failed = []
    began = time.monotonic()
    for path in files:
        status, output, seconds = run_alone(path)
        passed = status in (0, NOTHING_TO_RUN)
        summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
        print(f"alone: {path.relative_to(ROOT)} {'ok' if passed else 'FAILED'} in {seconds:.0f} s: {summary}",
              flush=True)
        if not passed:
            failed.append(path.relative_to(ROOT))
            print("\n".join(output.splitlines()[-SHOWN_LINES:]), flush=True)
    print(f"alone: {len(files)} files in {time.monotonic() - began:.0f} s", flush=True)
    print(f"files: {len(files) - len(failed)} passed, {len(failed)} failed", flush=True)  # CI's closing line
    if failed:
        print(f"alone: {len(failed)} file(s) failed when run on their own: {' '.join(map(str, failed))}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
