"""Bit-for-bit repeatable CPU training, however busy the machine is, and fast beside other work.

Same seed, same run; a resumed run continues exactly. On the CPU one PyTorch kernel in the update
breaks that: the backward of advanced indexing (`hidden[rows, cols]` in the LM head's gather of the
completion positions, `x[rows]` in the shared-prompt attention of cohort_grpo/models/shared_prefix.py) is
`index_put_(..., accumulate=True)`, and where a position is gathered more than once (a prompt's last
position predicts the first token of each of its G completions; a prompt's tokens sit in each of its
completions' attention rows), the duplicates' gradients are summed into it. With more than one
intra-op thread and at least 32,768 elements, PyTorch sums them with atomic float adds from all the
threads at once (aten/src/ATen/native/cpu/IndexKernel.cpp), so the order of the additions, and the
last bit of the sum, follow which thread gets there first. On an idle machine the threads keep the
same pace and the order rarely changes; beside other work it does, and runs that should be identical
drift apart by a few float32 units from that step on (1e-9..1e-7 in the weights after 8 steps).

`torch.use_deterministic_algorithms(True)` makes that kernel sum serially, in index order (no slower
here than the contended atomics: these sums are small). On the CPU the flag picks the serial version of
such accumulating scatters and nothing else the training step calls; `warn_only` keeps a run going
(with a warning) should some op lack a deterministic version, and uninitialised memory is left as it
is (no NaN fill). GPU runs are left alone unless `full_determinism` asks (TRL's option): there the flag swaps
many kernels for slower ones.

Threads (`cpu_threads`): PyTorch's intra-op threads (OpenMP) wait for each other at the end of every
parallel region, spinning first. When another busy process shares a core with one of them, every region
waits for the thread the scheduler has put aside, and a step can take many times longer. One thread
fewer than the cores leaves the other program a core of its own. The count is fixed for the run, so the
numbers do not depend on how busy the machine is.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator

import numpy as np
import torch
import torch.utils.deterministic


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and PyTorch's global generators from the run's seed (the same run from the same seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cpu_thread_count(setting: int | str = "auto") -> int:
    """The intra-op threads of a CPU run: `setting` when it is a count, else OMP_NUM_THREADS when set, else
    one fewer than the cores this process may run on (at least one)."""
    if isinstance(setting, int) and not isinstance(setting, bool):
        return setting
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def prepare_full_determinism() -> None:
    """Before a run's first CUDA work with `full_determinism`: cuBLAS picks its reduction order by the
    workspace it has, so it needs a fixed one (read when its handle is made, hence before any matrix product)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def run_determinism(device: torch.device, threads: int | None = None, full: bool = False) -> Iterator[None]:
    """Inside the block, on the CPU (and with `full` on any device): PyTorch's deterministic algorithms on
    (warn-only, no fill of uninitialised memory); on the CPU `threads` intra-op threads (None: as they are).
    On a GPU, `full` also swaps the accumulating kernels (scatters, the attention backward's atomics) for
    ordered ones, at some speed, so that a run repeats, and a resumed run continues, bit for bit. The
    process's previous settings are restored on exit."""
    if device.type != "cpu" and not full:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory, torch.get_num_threads(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if full:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if threads is not None and device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
        torch.set_num_threads(before[3])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[4], before[5]
