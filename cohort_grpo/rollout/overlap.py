"""Host-side bookkeeping that lets the engine enqueue the next decode chunk before it reads the last.

The GPU runs decode steps in chunks; after each chunk the host must learn which sequences
finished. Reading that with a blocking copy leaves the GPU idle for the whole host round trip
(reading, retiring, admitting, prefilling, launching). Instead the progress after a chunk is
copied into pinned host memory without blocking (`Snapshot`), and the host decides the next chunk
from bounds it knows without reading anything (`HostProgress`): a slot advances at most one token
a step and stops at its limit. Finished rows are frozen by `SlotState.advance`, so a chunk
launched over a row that has in fact already finished changes nothing in it. Retired rows are
likewise copied out without blocking (`Retirement`) and collected once, at the end of the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cohort_grpo.rollout.sequence import Sequence, SlotState
from cohort_grpo.rollout.batch import to_device as pinned_to_device
from cohort_grpo.rollout.sampler import find_stop_string


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, enqueued without waiting for the stream (pinned memory, so
    the copy is truly asynchronous); read it only after an event recorded after it has completed.
    On the CPU a plain copy, so CPU runs take the same path."""
    if tensor.device.type != "cuda":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def to_device(values: list | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host integers (a list, as a long tensor) on `device` without a host sync (`batch.to_device`):
    a copy from pageable memory, what `torch.tensor(values, device=cuda)` does, waits for every
    kernel already enqueued, which would stall the host behind the chunk launched ahead."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long)
    return pinned_to_device(tensor, device)


def record_event(device: torch.device) -> torch.cuda.Event | None:
    """An event on the current stream after everything enqueued so far (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HostProgress:
    """Bounds on each running sequence's generated count, known to the host without a sync.

    A sequence's count is known exactly as of the last snapshot read (or its prefill), when
    `steps` (decode steps enqueued in this generate() call) stood at its mark; every step
    enqueued since adds at most one token, and none past its limit. So `upper` bounds the count
    from above; `seq.generated` bounds it from below (an EOS may have ended it at any step since).
    Every chunk covers every running slot, so one step counter serves all sequences.
    """

    def __init__(self):
        self.steps = 0
        self._mark: dict[int, int] = {}  # sequence index -> `steps` when its count was last known

    def known(self, seq: Sequence, generated: int, at_steps: int) -> None:
        seq.generated = generated
        self._mark[seq.index] = at_steps

    def known_at(self, seq: Sequence) -> int:
        """`steps` when the sequence's count was last known (its prefill, or the last snapshot read)."""
        return self._mark[seq.index]

    def pending(self, seq: Sequence) -> int:
        """Decode steps enqueued over `seq` since its count was known."""
        return self.steps - self._mark[seq.index]

    def upper(self, seq: Sequence) -> int:
        return min(seq.limit, seq.generated + self.pending(seq))


@dataclass
class Snapshot:
    """Finished flags and generated counts of slots [0, width) right after one chunk, on their way
    to the host; `tokens` too when stop strings must be scanned."""

    rows: list[tuple[int, Sequence]]  # (slot, sequence) of every running sequence at the copy
    steps: int  # `HostProgress.steps` after the chunk: the counts are exact as of then
    progress: torch.Tensor  # [2, width] long: finished, generated
    tokens: torch.Tensor | None  # [width, columns] long, or None without stop strings
    ready: torch.cuda.Event | None

    @classmethod
    def enqueue(cls, state: SlotState, rows: list[tuple[int, Sequence]], steps: int,
                token_columns: int | None) -> Snapshot:
        """Copy the progress of slots [0, last running slot] (tokens too, given `token_columns`)."""
        width = rows[-1][0] + 1
        progress = to_host(torch.stack([state.finished[:width].long(), state.generated[:width]]))
        tokens = None if token_columns is None else to_host(state.tokens[:width, :token_columns])
        return cls(rows, steps, progress, tokens, record_event(state.generated.device))

    def wait(self) -> None:
        """The host sync: block until the copies have landed."""
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class Retirement:
    """Rows copied out when their sequences were retired: tokens and log-probs of the first
    `columns` positions (no count can exceed them) and the counts the GPU reached. A row cut by a
    stop string may have decoded further (a chunk was already enqueued); `cuts` says where it ends."""

    sequences: list[Sequence]
    cuts: list[int | None]
    tokens: torch.Tensor  # [rows, columns] long
    logprobs: torch.Tensor  # [rows, columns] float32
    counts: torch.Tensor  # [rows] long
    ready: torch.cuda.Event | None
    paused: bool = False  # rows stopped before they finished (`Engine.generate_until`)
    routes: torch.Tensor | None = None  # [rows, positions, MoE layers, k] int16: a MoE model's experts per token

    @classmethod
    def enqueue(cls, state: SlotState, slots: torch.Tensor, sequences: list[Sequence], cuts: list[int | None],
                columns: int, paused: bool = False, routes: torch.Tensor | None = None) -> Retirement:
        """Copy the first `columns` tokens and log-probs of rows `slots`, and their counts; with `routes`
        (the KV cache's), the experts chosen at every position of their prompts and those columns."""
        if routes is not None:
            positions = min(max(len(seq.prompt) for seq in sequences) + columns, routes.shape[1])
            routes = to_host(routes[slots, :positions])
        return cls(sequences, cuts, to_host(state.tokens[slots, :columns]), to_host(state.logprobs[slots, :columns]),
                   to_host(state.generated[slots]), record_event(slots.device), paused, routes)

    def landed(self) -> bool:
        """Whether the copies are done (never waits)."""
        return self.ready is None or self.ready.query()

    def finish(self, tokenizer, stop: list[str], eos_token_ids: list[int]) -> None:
        """Wait for the copies, then record each sequence's tokens, log-probs and finish reason."""
        if self.ready is not None:
            self.ready.synchronize()
        eos = set(eos_token_ids)
        for row, (seq, cut) in enumerate(zip(self.sequences, self.cuts)):
            count = int(self.counts[row])
            if cut is None and stop:  # retired at its limit before the last tokens were scanned
                cut = find_stop_string(tokenizer, self.tokens[row, :count].tolist(), seq.stop_checked_upto, stop)
            kept = count if cut is None else cut  # a cut row's later columns were decoded in vain
            seq.tokens = self.tokens[row, :kept].clone()
            seq.logprobs = self.logprobs[row, :kept].clone()
            if self.routes is not None:
                seq.routes = self.routes[row, : len(seq.prompt) + kept].clone()
            stopped = cut is not None or (kept > 0 and int(seq.tokens[-1]) in eos)
            if self.paused and not stopped and kept < seq.limit:
                seq.finish_reason = None  # paused before it finished: it goes on in a later call
            else:
                seq.finish_reason = "stop" if stopped else "length"
