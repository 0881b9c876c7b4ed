"""Start-up: `cohort-grpo --version`, `--help` and a mistyped command line answer before torch and transformers load.

The import check holds on any machine, busy or idle; the wall-time bound is generous (the answer takes about
0.15 s on an idle 2-core machine, the old eager imports 6-7 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "datasets")


def run_cohort(*argv: str) -> tuple[subprocess.CompletedProcess, set[str], float]:
    """`python -X importtime -m cohort_grpo ARGV` on this checkout's code: the result, the top-level packages it
    imported, and its wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "cohort_grpo", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=120)
    seconds = time.perf_counter() - started
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    return done, imported, seconds


@pytest.mark.parametrize("argv, code, words", [
    (["--version"], 0, "cohort "),
    (["--help"], 0, "usage: cohort-grpo [train]"),
    (["trian"], 2, "unknown command 'trian'"),
    (["train", "--lerning_rate", "1e-5"], 2, "unknown option 'lerning_rate'"),
    (["train", "--temperature", "0"], 2, "temperature=0"),
    (["train", "--help"], 0, "usage: cohort-grpo train"),
    (["eval", "--help"], 0, "usage: cohort-grpo eval"),
    (["eval", "--limt", "3"], 2, "unknown option --limt"),
    (["sft", "--help"], 0, "usage: cohort-grpo sft"),
    (["sft", "--modle", "x"], 2, "unknown option"),
    (["chat", "--help"], 0, "usage: cohort-grpo chat"),
    (["generate", "--help"], 0, "usage: cohort-grpo generate"),
])
def test_answers_without_loading_torch_or_transformers(argv, code, words):
    done, imported, _ = run_cohort(*argv)
    assert done.returncode == code, done.stderr[-2000:]
    assert words in done.stdout + done.stderr
    assert "cohort_grpo" in imported  # the import log was read
    assert not imported & set(HEAVY), f"cohort {' '.join(argv)} imported {sorted(imported & set(HEAVY))}"


def test_version_answers_within_a_generous_bound():
    import cohort_grpo

    done, _, seconds = run_cohort("--version")  # -X importtime adds little: one line per module to stderr
    assert done.returncode == 0 and done.stdout.strip() == f"cohort {cohort_grpo.__version__}"
    assert seconds < 2.5, f"cohort-grpo --version took {seconds:.2f} s"


def test_the_public_names_still_import_from_the_package():
    import cohort_grpo
    from cohort_grpo.trainer.grpo_trainer import GRPOTrainer
    from cohort_grpo.config.grpo_config import GRPOConfig

    assert cohort_grpo.GRPOTrainer is GRPOTrainer and cohort_grpo.GRPOConfig is GRPOConfig
    assert set(cohort_grpo.__all__) <= set(dir(cohort_grpo))
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        cohort_grpo.GRPOTrainr  # noqa: B018
