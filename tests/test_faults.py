"""Faults in a job of several ranks: a rank killed, a sampling rank killed, a weight broadcast that never
completes. Each ends the job within a bounded time with one line naming the rank and what failed, and
--resume from the newest checkpoint then trains what the uninterrupted run trains."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.faults import INJECT_ENV, job_failure_line, wait_all, withheld_weights
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.run.failure import newest_checkpoint
from test_distributed import REWARD_MODULE, environment, rank_one_pid, run, step_records, train_options

TOLERANCE = 1e-5


# ---- the pieces ----------------------------------------------------------------------------------------------
def write_reports(folder: Path, torchrun: dict, ranks: dict) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "torchrun.json").write_text(json.dumps(torchrun))
    for rank, (at, line) in ranks.items():
        (folder / f"rank-{rank}.json").write_text(json.dumps({"time": at, "line": line}))
    return folder


def test_the_root_cause_is_a_killed_rank_else_the_first_line_a_rank_left(tmp_path):
    lost = "rank 0 stopped waiting for a message from sampling rank 2 after 0.1 s (Connection closed by peer)"
    killed = write_reports(tmp_path / "killed", {"2": {"exitcode": -9, "signal": "SIGKILL", "time": 10},
                                                 "0": {"exitcode": 2, "signal": None, "time": 10}}, {0: (9.5, lost)})
    three = Placement(world_size=3, rollout_gpus=1)
    assert job_failure_line(killed, three) == "rank 2 (sampling rank) was killed by SIGKILL"
    # Ranks that torchrun stopped (SIGTERM) are no cause; the earliest line is, without its leading "rank N".
    hung = write_reports(tmp_path / "hung", {"1": {"exitcode": -15, "signal": "SIGTERM", "time": 20},
                                             "0": {"exitcode": 2, "signal": None, "time": 20}},
                         {0: (19.0, lost), 2: (18.0, "rank 2 stopped waiting for the weight broadcast")})
    assert job_failure_line(hung, three) == \
        "rank 2 (sampling rank) stopped waiting for the weight broadcast"
    # A collective that merely failed is a symptom: the line that names what its rank waited for is the
    # cause, even when written later (a rank that waits on the others can time out first under load).
    symptom = ("rank 0 stopped: a collective with the other ranks failed (wait timeout after 5000ms); another rank "
               "died or hung (--ddp_timeout bounds the wait)")
    racing = write_reports(tmp_path / "racing", {"0": {"exitcode": 2, "signal": None, "time": 30},
                                                 "1": {"exitcode": 2, "signal": None, "time": 30}},
                           {0: (25.0, symptom), 1: (25.2, "rank 1 stopped waiting for the weight broadcast")})
    assert job_failure_line(racing, Placement(world_size=2, rollout_gpus=1)) == \
        "rank 1 (sampling rank) stopped waiting for the weight broadcast"
    # A wait the peer's closing ended is a symptom too: the peer's own deadline is the cause, written later.
    closed = ("rank 0 stopped waiting for a message from sampling rank 1 after 0.0 s (Application timeout caused "
              "pair closure): that rank died or hung (--ddp_timeout bounds the wait)")
    closing = write_reports(tmp_path / "closing", {"0": {"exitcode": 2, "signal": None, "time": 40},
                                                   "1": {"exitcode": 2, "signal": None, "time": 40}},
                            {0: (35.0, closed), 1: (35.1, "rank 1 stopped waiting for the weight broadcast after 5.0 s "
                                                          "(Timed out)")})
    assert job_failure_line(closing, Placement(world_size=2, rollout_gpus=1)) == \
        "rank 1 (sampling rank) stopped waiting for the weight broadcast after 5.0 s (Timed out)"
    assert job_failure_line(write_reports(tmp_path / "bare", {"1": {"exitcode": 1, "signal": None, "time": 3}}, {}),
                            Placement(world_size=2)) == "rank 1 (trainer) exited with code 1"
    assert job_failure_line(tmp_path / "nothing", Placement(world_size=2)) is None


def test_a_wait_that_never_completes_ends_at_its_deadline_naming_what(monkeypatch):
    class Stuck:
        def is_completed(self):
            return False

        def wait(self):
            raise AssertionError("a polled wait must not block in wait()")

    monkeypatch.setenv("RANK", "2")
    started = time.monotonic()
    with pytest.raises(CohortError, match=r"^rank 2 stopped waiting for the weight broadcast of policy version 3 "
                                          r"from rank 0 after 0\.[2-9] s \(Timed out"):
        wait_all([Stuck()], "the weight broadcast of policy version 3 from rank 0", 0.2, poll=True)
    assert time.monotonic() - started < 2


def test_a_teardown_that_never_completes_is_left_after_its_bound(monkeypatch, capsys):
    """The end of a run: a process group whose teardown waits forever (NCCL waiting on a gone peer) does not
    hold the finished job; `Parallel.close` returns after DESTROY_TIMEOUT_S with one line naming the rank."""
    import threading

    import torch
    import torch.distributed as dist

    from cohort_grpo.parallel import distributed

    forever = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: forever.wait())
    monkeypatch.setattr(distributed, "DESTROY_TIMEOUT_S", 0.2)
    parallel = object.__new__(distributed.Parallel)
    parallel.owns_group, parallel.device, parallel.rank = True, torch.device("cpu"), 1
    started = time.monotonic()
    parallel.close()
    forever.set()
    assert time.monotonic() - started < 5 and not parallel.owns_group
    assert "cohort: rank 1: the process group's teardown did not finish within 0.2 s" in capsys.readouterr().err


@pytest.mark.parametrize("world_size, teardown", [("2", False), ("1", True)])
def test_a_rank_of_a_job_ends_without_the_interpreters_teardown(world_size, teardown):
    """`python -m cohort_grpo` ends a torchrun rank (WORLD_SIZE > 1) by os._exit once its streams are flushed, so no
    gloo worker thread can be caught in the interpreter's finalization; a lone process exits normally."""
    script = ("import atexit, sys; atexit.register(lambda: print('teardown'));"
              "from cohort_grpo.cli.main import exit_process; print('written', end=''); print('told', end='', file=sys.stderr);"
              "exit_process(3)")
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, WORLD_SIZE=world_size),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stderr.endswith("told")
    assert done.stdout == ("written" + ("teardown\n" if teardown else ""))


def test_the_injected_fault_withholds_weights_from_its_version_on(monkeypatch):
    assert not withheld_weights(5)
    monkeypatch.setenv(INJECT_ENV, "withhold_weights:2")
    assert [withheld_weights(v) for v in range(4)] == [False, False, True, True]


# ---- real jobs: one trainer and one sampling rank (gloo) -----------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    (folder / "rewardmod.py").write_text(REWARD_MODULE)
    return folder


def job(model: str, out: Path, *extra: str) -> list[str]:
    """`cohort-grpo train --nproc_per_node 2 --rollout_gpus 1` (partial rollouts, 2 updates behind), a checkpoint
    after every step."""
    return [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2",
            *train_options(model, out, 4, "--async_rollouts", "true", "--rollout_gpus", "1", "--eval_limit", "0",
                           "--save_steps", "1", "--save_total_limit", "0", *extra)]


def failed(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("cohort: error:")]


@pytest.mark.slow
def test_a_weight_broadcast_that_never_completes_ends_within_the_timeout_and_resume_equals_the_whole_run(
        root, tiny_dir):
    reference = root / "whole"
    run(root, job(tiny_dir, reference, "--max_steps", "4"), timeout=300)

    out = root / "withheld"
    started = time.monotonic()
    done = subprocess.run(job(tiny_dir, out, "--max_steps", "4", "--ddp_timeout", "5"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=environment(root, **{INJECT_ENV: "withhold_weights:2"}))
    elapsed = time.monotonic() - started
    assert done.returncode != 0 and elapsed < 120, (elapsed, done.stdout[-3000:])
    [line] = failed(done.stdout)
    assert line.startswith("cohort: error: rank 1 (sampling rank) stopped waiting for the weight broadcast of "
                           "policy version 2 from rank 0 after 5."), line
    assert "continue from the newest checkpoint with --resume" in line
    assert not (out / "checkpoint-4").exists()

    done = run(root, job(tiny_dir, out, "--max_steps", "4", "--resume", "true"), timeout=300)
    assert "resumed from" in done
    got, expected = step_records(out), step_records(reference)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for mine, theirs in zip(got, expected):
        assert abs(mine["loss"] - theirs["loss"]) <= TOLERANCE and abs(mine["reward"] - theirs["reward"]) <= TOLERANCE
    weights, expected_weights = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert max((weights[k] - expected_weights[k]).abs().max().item() for k in weights) <= TOLERANCE


@pytest.mark.slow
def test_a_sampling_rank_killed_ends_the_job_with_one_line_naming_it(root, tiny_dir):
    out = root / "killed"
    tag = f"cohort-dead-sampler-{os.getpid()}"
    process = subprocess.Popen(job(tiny_dir, out, "--max_steps", "1000", "--ddp_timeout", "60"),
                               env=environment(root, COHORT_TEST_TAG=tag), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300  # a guard only: two CPU ranks beside a busy suite start slowly
        while not (out / "metrics.jsonl").is_file() or not step_records(out):
            assert process.poll() is None and time.monotonic() < deadline, "the job did not reach step 1"
            time.sleep(0.2)
        os.kill(rank_one_pid(tag), signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = process.communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0 and elapsed < 45, (elapsed, output[-3000:])
    # The kill lands once step 1 is logged: step 1's checkpoint, which waits on the killed rank, may or may not be
    # complete by then; the line offers --resume exactly when one is.
    ending = (" — continue from the newest checkpoint with --resume" if newest_checkpoint(out) is not None
              else " before it saved a checkpoint")
    assert failed(output) == ["cohort: error: rank 1 (sampling rank) was killed by SIGKILL; the job stopped"
                              + ending], output[-3000:]
