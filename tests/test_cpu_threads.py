"""The CPU run's thread count: one fewer than the cores by default, OMP_NUM_THREADS or cpu_threads when
given, set for the run and restored after it (timings beside a busy program: bench/busy_cpu.py)."""

import os

import pytest
import torch

from cohort_grpo.run.determinism import run_determinism, cpu_thread_count
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.errors import CohortError


def test_auto_leaves_one_core_to_other_work(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert cpu_thread_count("auto") == max(1, cores - 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert cpu_thread_count("auto") == 7
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert cpu_thread_count("auto") == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_thread_count("auto") == 3  # the environment's count wins over auto
    assert cpu_thread_count(2) == 2  # and an explicit count over both


def test_the_count_holds_inside_the_run_and_is_restored():
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    with run_determinism(torch.device("cpu"), wanted):
        assert torch.get_num_threads() == wanted
    assert torch.get_num_threads() == before
    with run_determinism(torch.device("meta"), wanted):  # not a CPU run: left alone
        assert torch.get_num_threads() == before


def test_a_count_below_one_is_refused():
    with pytest.raises(CohortError, match=r"cpu_threads=0 must be at least 1"):
        GRPOConfig(cpu_threads=0).validate()


def test_full_determinism_turns_the_ordered_kernels_on_for_a_gpu_run_and_restores_them(monkeypatch):
    """`full_determinism`: a GPU run (here the meta device stands for it) gets PyTorch's deterministic algorithms
    and cuDNN's, and cuBLAS a fixed workspace; the CPU's thread count is not touched; all restored after."""
    from cohort_grpo.run.determinism import prepare_full_determinism

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    prepare_full_determinism()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.get_num_threads())
    with run_determinism(torch.device("meta"), threads=before[2] + 1, full=True):
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert torch.get_num_threads() == before[2]
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.get_num_threads()) == before
