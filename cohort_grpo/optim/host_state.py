"""AdamW's state in host memory, streamed through the GPU one tensor at a time: full-parameter 8B on one card.

With bf16 weights, split fp32 masters and bf16 moments (`precision.py`), a trained parameter costs a GPU 10 bytes:
the weight (2), its gradient (2), the master's low half (2) and two moments (4). At the Llama-3.1-8B shape that
is 75 GiB before a single activation or cached key: more than an 80 GB card has once CUDA and the engine are
up. The optimizer's 6 of those bytes are read once a step, by the optimizer step alone, so they can wait in
host memory (ZeRO-Offload's split, Ren et al. 2021, with the step kept on the GPU): per tensor, its low half and
moments come over PCIe, the same one kernel (or chunked torch step) updates them, and they go back. On the GPU
this leaves the weights and gradients, 4 bytes a parameter, and two staging slots.

The copies are overlapped with the update: while piece k steps, piece k+1's state comes in on a side stream and
piece k−1's goes back (two staging slots, used in turn). A piece is a tensor, or a slice of at most
`PIECE_ELEMENTS` of a larger one (the kernel steps a slice with the noise of its place in the whole tensor, so
the bits do not change): the slots stay 0.75 GiB where the largest tensor's state (Llama-3.1-8B's embedding)
would make them 5.9 GiB. PCIe moves a 8B model's 45 GiB of state each way in
about a second at Gen5 rates, a small part of a step that samples thousands of tokens per sequence.

The host copy is one flat allocation for each kind of state (the low halves, each moment), registered with CUDA
as page-locked (`cudaHostRegister`) so the copies run asynchronously at full rate; torch's pinned allocator
rounds each allocation up to a power of two, which at these sizes could waste up to half the host's memory. The
arithmetic is unchanged: the same kernel reads and writes the same bits, only the address it finds them at moves,
so a run with its state in host memory steps to the same bits as one without (`tests/test_host_state.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch

from cohort_grpo.errors import CohortError

ALIGN = 256  # bytes: each tensor's view starts on this boundary (vectorised copies and kernels)
PIECE_ELEMENTS = 1 << 26  # the largest slice of a tensor staged at once by the kernel's step (6 bytes an element)


def holds_split_masters(dtype: str) -> bool:
    """Whether weights of `dtype` (the run's, settled: `optim.precision.resolve_dtype`) train with the split fp32
    masters and bf16 moments whose state can wait in host memory: bf16 only (float32 weights are their own
    masters; float16 trains with a loss scaler and whole fp32 masters)."""
    return dtype == "bfloat16"


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostState:
    """Each trainable tensor's optimizer state (each kind `name` of `dtypes[name]`, in the shape of its parameter) in
    host memory, one buffer a kind (`buffers[name]`); `tensors[i][name]` is tensor `i`'s view of it. `device`: where the step runs (on a CPU the copies
    are plain copies between two CPU tensors, which the tests use to check the bookkeeping)."""

    def __init__(self, shapes: list[torch.Size], dtypes: dict[str, torch.dtype], device: torch.device):
        self.device = device
        self.dtypes = dict(dtypes)
        # one buffer a name, so a checkpoint of the moments saves those bytes alone (torch.save writes a view's
        # whole storage); each tensor's view starts on an ALIGN-byte boundary
        starts: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for name, dtype in self.dtypes.items():
            starts[name], size = [], 0
            for shape in shapes:
                starts[name].append(size)
                size += _aligned(shape.numel() * dtype.itemsize) // dtype.itemsize
            sizes[name] = size
        wanted = sum(size * self.dtypes[name].itemsize for name, size in sizes.items())
        self.buffers: dict[str, torch.Tensor] = {}
        try:
            for name, dtype in self.dtypes.items():
                self.buffers[name] = torch.zeros(sizes[name], dtype=dtype)
        except RuntimeError as error:  # torch's "DefaultCPUAllocator: can't allocate memory"
            raise CohortError(f"offload_optimizer: the optimizer's state needs {wanted / 2**30:.1f} GiB of host "
                              f"memory and could not get it ({error}); pass --offload_optimizer false, or free host "
                              "memory") from None
        self.nbytes = wanted
        self.page_locked = device.type == "cuda" and all(page_lock(buffer) for buffer in self.buffers.values())
        self.tensors = [{name: buffer[starts[name][i]:starts[name][i] + shape.numel()].view(shape)
                         for name, buffer in self.buffers.items()} for i, shape in enumerate(shapes)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def describe(self) -> str:
        how = "page-locked" if self.page_locked else "pageable"
        return f"{self.nbytes / 2**30:.1f} GiB of {how} host memory"

    def _slot(self, elements: int) -> dict[str, torch.Tensor]:
        """A staging buffer on the device that holds `elements` of each kind of state."""
        return {name: torch.empty(elements, dtype=dtype, device=self.device) for name, dtype in self.dtypes.items()}

    def one_by_one(self, pieces: list[tuple[int, int, int]]) -> Iterator[tuple[tuple[int, int, int],
                                                                               dict[str, torch.Tensor]]]:
        """For each piece (i, start, stop) in turn — elements start:stop of tensor `i`, flattened — that piece's state
        on the device, for the caller to step in place before asking for the next; what it wrote goes back to the
        host. On a GPU the next piece's state comes in while this one steps, and the last one's goes back."""
        if not pieces:
            return
        largest = max(stop - start for _, start, stop in pieces)
        slots = [self._slot(largest) for _ in range(min(2, len(pieces)))]
        cuda = self.stream is not None
        compute = torch.cuda.current_stream(self.device) if cuda else None
        if cuda:  # the slots come from blocks the compute stream may still be using
            self.stream.wait_stream(compute)

        def host_views(k: int) -> dict[str, torch.Tensor]:
            i, start, stop = pieces[k]
            return {name: host.view(-1)[start:stop] for name, host in self.tensors[i].items()}

        def bring(k: int):
            i, start, stop = pieces[k]
            views = {name: slot[: stop - start] for name, slot in slots[k % len(slots)].items()}
            if not cuda:
                for name, host in host_views(k).items():
                    views[name].copy_(host)
                return views, None
            with torch.cuda.stream(self.stream):  # after the copy back of the piece that used this slot last
                for name, host in host_views(k).items():
                    views[name].copy_(host, non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(self.stream)
            return views, arrived

        try:
            pending = bring(0)
            for k, piece in enumerate(pieces):
                views, arrived = pending
                if k + 1 < len(pieces):
                    pending = bring(k + 1)
                if arrived is not None:
                    compute.wait_event(arrived)
                yield piece, views
                if not cuda:
                    for name, host in host_views(k).items():
                        host.copy_(views[name])
                    continue
                stepped = torch.cuda.Event()
                stepped.record(compute)
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(stepped)
                    for name, host in host_views(k).items():
                        host.copy_(views[name], non_blocking=True)
        finally:
            if cuda:  # the host copies are whole before anything reads them (a checkpoint), the slots free to go
                self.stream.synchronize()
            slots.clear()  # the staging buffers go back to the allocator

    def on_device(self, i: int) -> dict[str, torch.Tensor]:
        """Tensor `i`'s state copied to the device (the chunked step's: it writes them back with `put_back`)."""
        return {name: host.to(self.device, copy=True) for name, host in self.tensors[i].items()}

    def put_back(self, i: int, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            self.tensors[i][name].copy_(value)


def page_lock(buffer: torch.Tensor) -> bool:
    """Register `buffer` with CUDA as page-locked for as long as it lives; False where CUDA refuses (the copies
    then still run, synchronously)."""
    if buffer.numel() == 0:
        return False
    cudart = torch.cuda.cudart()
    pointer, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()  # cudaHostRegister counts bytes
    if int(cudart.cudaHostRegister(pointer, size, 0)) != 0:
        return False
    weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)
    return True
