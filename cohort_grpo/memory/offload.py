"""π_ref's weights in pinned host memory while they are not in use.

The reference model is read once a step, by the log-prob pass before the update; the rest of the
step (sampling, the update's forward, backward and optimizer step) never touches it. On a GPU its
bf16 weights (2.9 GiB at the Qwen2.5-1.5B shape) would otherwise sit in the update's memory peak.
`HostOffload` frees their device storage after each use and copies them back from a pinned host
copy on a side stream, started at the top of the next step so the copy (about 0.1 s at PCIe rates)
runs while the engine samples.

The parameters stay the same tensor objects (only their storage is resized to 0 and back, as FSDP
does), so compiled code and the modules that hold them see no difference. Outside `on_device` the
model refuses to run with a one-line error: on a GPU its kernels would read freed memory, an illegal
access that ends the process's CUDA context, not just the call.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch

from cohort_grpo.errors import CohortError


class HostOffload:
    """A frozen model's parameters kept on the host between uses (`enabled=False`: a no-op)."""

    def __init__(self, model: torch.nn.Module | None, enabled: bool = True):
        self.enabled = bool(enabled and model is not None)
        self.storages: list[torch.UntypedStorage] = []
        self.sizes: list[int] = []
        self.host: list[torch.Tensor] | None = None  # host copies; None until the first eviction
        self.host_stale = True  # the device copy was written since the host copy was taken
        self.resident = True
        self.stream: torch.cuda.Stream | None = None
        self.ready: torch.cuda.Event | None = None  # the prefetch's copies have finished
        if not self.enabled:
            return
        seen = set()
        for param in model.parameters():  # one entry per storage: tied and fused weights share one
            storage = param.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.storages.append(storage)
                self.sizes.append(storage.nbytes())
        self.device = next(model.parameters()).device
        model.register_forward_pre_hook(self._refuse_while_on_host)

    def _refuse_while_on_host(self, module, args) -> None:
        if not self.resident:
            raise CohortError("π_ref's weights are in host memory between its log-prob passes (--offload_ref_model): "
                              "call the reference model inside trainer.memory.reference_pass(), or pass "
                              "--offload_ref_model false to keep it on the GPU")

    def nbytes(self) -> int:
        return sum(self.sizes)

    def prefetch(self) -> None:
        """Start copying the weights back to the device; `on_device` waits for the copies."""
        if not self.enabled or self.resident:
            return
        cuda = self.device.type == "cuda"
        if cuda and self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream if cuda else None
        if cuda:  # the storage comes from blocks the main stream may still be using
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for storage, size in zip(self.storages, self.sizes):
            storage.resize_(size)
        with torch.cuda.stream(stream) if cuda else nullcontext():
            for storage, host in zip(self.storages, self.host):
                _bytes_view(storage).copy_(host, non_blocking=cuda)
        if cuda:
            self.ready = torch.cuda.Event()
            self.ready.record(stream)
        self.resident = True

    def restore(self) -> None:
        """The weights back on the device for good (until the next `on_device` block): after a run, code that
        reads the model reads its weights, not the emptied storage a kernel would fault on."""
        self.prefetch()
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None

    @contextmanager
    def on_device(self, modified: bool = False) -> Iterator[None]:
        """The weights on the device inside the block, freed there again after it. `modified=True`
        when the block writes them (π_ref ← π_θ, a resumed checkpoint): the host copy is refreshed.
        If the block raises, the weights stay on the device (a modified host copy stays marked stale)."""
        if not self.enabled:
            yield
            return
        self.restore()
        self.host_stale = self.host_stale or modified
        yield
        self.evict()

    def evict(self) -> None:
        """Free the device storage, copying it to the host first when the host copy is missing or stale."""
        if not self.enabled or not self.resident:
            return
        if self.host is None or self.host_stale:
            pin = self.device.type == "cuda"
            self.host = [torch.empty(size, dtype=torch.uint8, pin_memory=pin).copy_(_bytes_view(storage))
                         for storage, size in zip(self.storages, self.sizes)]
            self.host_stale = False
        for storage in self.storages:
            storage.resize_(0)  # freed in the main stream's order, after every kernel that reads it
        self.resident = False


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
