"""Bit-for-bit repeatable CPU training, however busy the machine is.

Same seed, same run; a resumed run continues exactly. On the CPU one PyTorch kernel in the update
breaks that: the backward of advanced indexing (`hidden[rows, cols]` in the LM head's gather of the
completion positions, `x[rows]` in the shared-prompt attention of cohort/models/shared_prefix.py) is
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
is (no NaN fill). GPU runs are left alone: there the flag would swap many kernels for slower ones.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def cpu_determinism(device: torch.device) -> Iterator[None]:
    """Inside the block, with `device` the CPU: PyTorch's deterministic algorithms on (warn-only, no
    fill of uninitialised memory). The process's previous settings are restored on exit."""
    if device.type != "cpu":
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]
