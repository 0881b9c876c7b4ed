"""Continuous batching: which sequence occupies which KV-cache slot, and how wide a decode step is.

Waiting sequences are admitted into the lowest free slots, finished ones are retired at check
time, and a decode step covers slots [0, width) where width is the smallest batch bucket holding
every occupied slot. When the running set shrinks and its slots are scattered, `compaction_moves`
packs it back to the front so the step narrows to a smaller bucket (the idea of iteration-level
scheduling, Yu et al. 2022, "Orca", and of vLLM's continuous batching, Kwon et al. 2023).
"""

from __future__ import annotations

import bisect
from collections import deque

from cohort_grpo.rollout.sequence import Sequence

# The most sequences an engine decodes at once unless told otherwise (`Engine(max_batch_size=)`); the run's
# `max_concurrent_sequences=auto` never goes above it, so where memory allows, a run samples as it always has.
ENGINE_SLOTS = 256


def batch_buckets(max_batch_size: int) -> list[int]:
    """Decode widths a CUDA graph is kept for: 1, 2, 4, 8, 16, then steps of about 1.5x, then max.

    Padding a step to the next bucket costs little because decoding small batches is bound by
    reading the weights, not by the batch size.
    """
    sizes = [1, 2, 4, 8, 16]
    while sizes[-1] < max_batch_size:
        nxt = sizes[-1] * 3 // 2
        nxt = -(-nxt // 16) * 16  # multiples of 16 keep matmul shapes friendly
        sizes.append(nxt)
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


def round_up_to_bucket(value: int, buckets: list[int]) -> int:
    """The smallest bucket >= value (buckets ascending; value must not exceed the last)."""
    return buckets[bisect.bisect_left(buckets, value)]


class Scheduler:
    """Slot bookkeeping for one `Engine.generate` call."""

    def __init__(self, num_slots: int, buckets: list[int] | None = None):
        self.num_slots = num_slots
        self.buckets = buckets or list(range(1, num_slots + 1))  # no padding when no buckets
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * num_slots
        self.finished: list[Sequence] = []

    # ---- queue -----------------------------------------------------------------------------
    def add(self, sequences: list[Sequence]) -> None:
        self.waiting.extend(sequences)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running_slots()

    def running_slots(self) -> list[int]:
        return [slot for slot, seq in enumerate(self.slots) if seq is not None]

    def free_slots(self) -> list[int]:
        return [slot for slot, seq in enumerate(self.slots) if seq is None]

    # ---- transitions -----------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the lowest free slots; return the admitted ones."""
        admitted = []
        for slot in self.free_slots():
            if not self.waiting:
                break
            seq = self.waiting.popleft()
            seq.slot = slot
            self.slots[slot] = seq
            admitted.append(seq)
        return admitted

    def retire(self, seq: Sequence) -> None:
        """Free the slot of a sequence whose result has been recorded."""
        assert seq.slot is not None and self.slots[seq.slot] is seq
        self.slots[seq.slot] = None
        seq.slot = None
        self.finished.append(seq)

    def width(self) -> int:
        """Decode width: the smallest bucket covering every occupied slot (0 when none runs)."""
        running = self.running_slots()
        if not running:
            return 0
        return round_up_to_bucket(running[-1] + 1, self.buckets)

    def compaction_moves(self) -> list[tuple[int, int]]:
        """(source, target) slot pairs that pack the running sequences into the narrowest bucket.

        Only the sequences above the bucket that fits the running count move, each into the lowest
        free slot; the caller copies their KV-cache rows and slot state, then calls `apply_moves`.
        """
        running = self.running_slots()
        if not running:
            return []
        target_width = round_up_to_bucket(len(running), self.buckets)
        if running[-1] < target_width:
            return []
        movers = [slot for slot in running if slot >= target_width]
        holes = [slot for slot in self.free_slots() if slot < target_width]
        return list(zip(movers, holes))

    def apply_moves(self, moves: list[tuple[int, int]]) -> None:
        for source, target in moves:
            seq = self.slots[source]
            assert seq is not None and self.slots[target] is None
            self.slots[target], self.slots[source] = seq, None
            seq.slot = target
