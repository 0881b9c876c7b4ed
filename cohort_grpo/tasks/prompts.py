"""`PromptStream`: Algorithm 1's "sample a batch D_b from D", epoch after epoch, resumable exactly.

Every rank walks the same shuffled order of the rows (epochs repeat, each reshuffled) and then takes
its own contiguous block of whole prompts (`Parallel.shard`), so a prompt's G completions stay on
one rank. The stream's
random generator also draws each step's sampling seed, so that the data position and the sampling
noise are one state to save and restore (`state_dict`).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator


class PromptStream:
    def __init__(self, rows: list[dict], rows_per_step: int, seed: int):
        self.rows, self.rows_per_step = rows, rows_per_step
        self.rng = random.Random(seed)
        self.order: list[int] = []  # what is left of the current epoch, taken from the end

    def next_rows(self) -> list[dict]:
        """The next step's rows, for all ranks together (prompts_per_step × ranks)."""
        rows = []
        while len(rows) < self.rows_per_step:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.rng.shuffle(self.order)
            rows.append(self.rows[self.order.pop()])
        return rows

    def next_seed(self) -> int:
        """The seed of the next rollout's sampling noise (the same on every rank)."""
        return self.rng.randrange(2**31)

    def switch_rows(self, rows: list[dict]) -> None:
        """A new source of prompts (a curriculum stage): a fresh epoch over `rows`."""
        self.rows, self.order = rows, []

    @contextmanager
    def unchanged(self) -> Iterator[None]:
        """Draws inside the block (a reward model's warm-up sampling) leave the stream as it was."""
        state = self.state_dict()
        try:
            yield
        finally:
            self.load_state_dict(state)

    def state_dict(self) -> dict:
        return {"data_order": list(self.order), "data_rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.order = [int(i) for i in state["data_order"]]
        self.rng.setstate(state["data_rng"])
