"""The reward model's replay buffer and the mini-batches that mix fresh and replayed samples.

DeepSeekMath (Shao et al. 2024), Algorithm 1, ends every step with "update r_φ through continuous
training using a replay mechanism" (their §4.1.1 notes the reward model's data comes from rule
judgments). Training only on the newest policy samples would let r_φ forget how earlier mistakes
look; replaying a bounded memory of older (prompt, completion, label) samples keeps them in view.

Two bounding policies: "fifo" keeps the newest `capacity` samples; "reservoir" (Vitter 1985,
Algorithm R) keeps a uniform random subset of every sample ever offered. A mini-batch of `B` units
holds exactly `round(replay_ratio · B)` replayed units and the rest fresh; a unit is a sample
(pointwise loss) or an ordered pair from one group (pairwise loss, Bradley & Terry 1952).
Everything here is plain Python data, so `state_dict()` survives `torch.save(…)` /
`torch.load(…, weights_only=True)` and JSON alike.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cohort_grpo.config.choices import CHOICES
from cohort_grpo.errors import CohortError

BUFFER_POLICIES = CHOICES["rm_buffer_policy"]


@dataclass(frozen=True)
class Sample:
    """One labelled completion. `group` identifies the prompt's group (unique over the whole run)."""

    prompt: str
    completion: str
    label: float
    group: int


class ReplayBuffer:
    """At most `capacity` samples, bounded by `policy` ("fifo" or "reservoir")."""

    def __init__(self, capacity: int, policy: str = "fifo", seed: int = 0):
        if capacity < 1:
            raise CohortError(f"rm_buffer_size={capacity} must be at least 1")
        if policy not in BUFFER_POLICIES:
            raise CohortError(f"unknown rm_buffer_policy {policy!r}; choose one of {list(BUFFER_POLICIES)}")
        self.capacity, self.policy = capacity, policy
        self.items: list[Sample] = []
        self.seen = 0  # samples ever offered (reservoir sampling needs the count)
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, samples: list[Sample]) -> None:
        for sample in samples:
            self.seen += 1
            if len(self.items) < self.capacity:
                self.items.append(sample)
            elif self.policy == "fifo":
                self.items.pop(0)
                self.items.append(sample)
            else:  # Algorithm R: the n-th sample replaces a random slot with probability capacity / n
                slot = self.rng.randrange(self.seen)
                if slot < self.capacity:
                    self.items[slot] = sample

    def state_dict(self) -> dict:
        return {"capacity": self.capacity, "policy": self.policy, "seen": self.seen,
                "items": [[s.prompt, s.completion, s.label, s.group] for s in self.items],
                "rng": rng_state(self.rng)}

    def load_state_dict(self, state: dict) -> None:
        self.capacity, self.policy, self.seen = int(state["capacity"]), state["policy"], int(state["seen"])
        self.items = [Sample(p, c, float(y), int(g)) for p, c, y, g in state["items"]]
        set_rng_state(self.rng, state["rng"])


def within_group_pairs(samples: list[Sample]) -> list[tuple[int, int]]:
    """(better, worse) index pairs of samples that share a group and have different labels."""
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group, []).append(i)
    pairs = []
    for members in by_group.values():
        for a in members:
            for b in members:
                if samples[a].label > samples[b].label:
                    pairs.append((a, b))
    return pairs


class MixedBatches:
    """Mini-batches of `batch_size` units: `round(replay_ratio · batch_size)` from `replayed`, the rest
    from `fresh`. Fresh units are walked in shuffled passes (every fresh unit is seen before any is
    repeated); replayed ones are drawn uniformly without replacement within a batch. A pool smaller
    than its share is drawn with replacement; an empty pool hands its share to the other one."""

    def __init__(self, fresh: list, replayed: list, batch_size: int, replay_ratio: float, rng: random.Random):
        self.fresh, self.replayed, self.rng = fresh, replayed, rng
        if not fresh and not replayed:
            self.num_fresh = self.num_replayed = 0
        elif not replayed:
            self.num_fresh, self.num_replayed = batch_size, 0
        elif not fresh:
            self.num_fresh, self.num_replayed = 0, batch_size
        else:
            self.num_replayed = round(replay_ratio * batch_size)
            self.num_fresh = batch_size - self.num_replayed
        self._order: list = []

    def __bool__(self) -> bool:
        return bool(self.num_fresh + self.num_replayed)

    def next(self) -> tuple[list, list]:
        """(fresh units, replayed units) of the next mini-batch."""
        return self._fresh(self.num_fresh), _draw(self.replayed, self.num_replayed, self.rng)

    def _fresh(self, count: int) -> list:
        if count > len(self.fresh):
            return [self.rng.choice(self.fresh) for _ in range(count)]
        out = []
        while len(out) < count:
            if not self._order:
                self._order = list(self.fresh)
                self.rng.shuffle(self._order)
            out.append(self._order.pop())
        return out


def _draw(pool: list, count: int, rng: random.Random) -> list:
    if count <= len(pool):
        return rng.sample(pool, count)
    return [rng.choice(pool) for _ in range(count)]


def rng_state(rng: random.Random) -> list:
    """random.Random's state as nested lists (no tuples), so JSON keeps it exactly too."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state) -> None:
    """Put `rng` back in a state `rng_state` returned (also after a JSON round trip)."""
    version, internal, gauss = state
    rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
