"""Partial rollouts: a step trains the first groups to complete; the others go on in the next call.

A sampling call that must return every completion of its batch lasts as long as its longest one, and with
R1-style lengths (median ~1k tokens, a tail to the 8k cap) most of that time decodes a handful of rows.
Here each sampling rank keeps more groups in flight than a step trains (the first request brings a second
batch of prompts: over-sampling), and a call stops at the first check where, for every trainer it serves,
`prompts_per_step` groups have all their G completions. Those groups go to the trainer, oldest first; the
sequences still decoding pause with the tokens they have and continue in the next call, from prompt +
those tokens, under that call's newer weights (Kimi Team 2025, "Kimi k1.5", partial rollouts). Every token
keeps the log-prob of the weights that sampled it, so the trainer's per-token importance ratio
π_θ / π_sampler stays right for a completion sampled by several versions.

Staleness is that of a group's oldest tokens. With partial rollouts a step's requests go out one update
ahead (a fresh group is 1 version old when trained), and a group may be carried into later calls while it
stays within `max_staleness`: a call does not stop before every group that could not wait for the next
one is complete, and a group that would still exceed it is dropped (`async/dropped_groups`; with the first
request's single extra batch that never happens). Where a call stops depends on the tokens only, never on
timing, so a run is as reproducible as without partial rollouts, and the pool travels with each rollout to
the trainer, whose checkpoint keeps it (an exact resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.rollout.batch import Batch
from cohort_grpo.rollout.sampler import Rollout


@dataclass
class GroupInFlight:
    """One prompt's G completions, some perhaps still unfinished."""

    serial: int  # order of arrival in its pool: among equally old groups, the first in goes first out
    row: dict
    prompt_ids: list[int]
    version: int  # the policy version (updates done) that sampled its first tokens
    tokens: list[list[int]]  # [G] each completion's tokens so far
    logprobs: list[list[float]]  # [G] their sampling log-probs
    finish_reasons: list[str | None]  # [G] None while unfinished
    calls: int = 0  # sampling calls it was decoded in (more than 1: it was carried over)

    @property
    def complete(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def unfinished(self) -> list[int]:
        return [g for g, reason in enumerate(self.finish_reasons) if reason is None]


@dataclass
class GroupPool:
    """One trainer's groups in flight on its sampling rank, as plain values (a checkpoint's)."""

    groups: list[GroupInFlight] = field(default_factory=list)
    next_serial: int = 0

    def add(self, rows: list[dict], prompt_ids: list[list[int]], version: int, group_size: int) -> None:
        for row, prompt in zip(rows, prompt_ids):
            self.groups.append(GroupInFlight(self.next_serial, row, prompt, version, [[] for _ in range(group_size)],
                                             [[] for _ in range(group_size)], [None] * group_size))
            self.next_serial += 1

    @staticmethod
    def must_go_now(group: GroupInFlight, step: int, max_staleness: int) -> bool:
        """Whether `group` would be too stale for step + 1, trained by the policy after `step` updates."""
        return step - group.version > max_staleness

    def ready(self, complete: set[int], step: int, count: int, max_staleness: int) -> bool:
        """With the groups of serials `complete` complete: are `count` of them there, and every group that
        cannot wait for the next step among them?"""
        return len(complete) >= count and all(
            group.serial in complete for group in self.groups if self.must_go_now(group, step, max_staleness))

    def deliver(self, step: int, count: int, max_staleness: int) -> tuple[list[GroupInFlight], int]:
        """The `count` oldest complete groups for `step`, and how many groups had to be dropped (too stale to
        wait for step + 1)."""
        done = sorted((g for g in self.groups if g.complete), key=lambda g: (g.version, g.serial))[:count]
        taken = {g.serial for g in done}
        kept = [g for g in self.groups if g.serial not in taken]
        self.groups = [g for g in kept if not self.must_go_now(g, step, max_staleness)]
        return done, len(kept) - len(self.groups)

    def state_dict(self) -> dict:
        """Plain values; each group's tokens and log-probs as one flat tensor each (a rollout message carries
        the pool, so it stays small)."""
        groups = []
        for g in self.groups:
            groups.append({"serial": g.serial, "row": g.row, "prompt_ids": g.prompt_ids, "version": g.version,
                           "calls": g.calls, "finish_reasons": g.finish_reasons,
                           "lengths": [len(tokens) for tokens in g.tokens],
                           "tokens": torch.tensor([t for tokens in g.tokens for t in tokens], dtype=torch.int32),
                           "logprobs": torch.tensor([x for values in g.logprobs for x in values], dtype=torch.float32)})
        return {"groups": groups, "next_serial": self.next_serial}

    @classmethod
    def from_state(cls, state: dict) -> "GroupPool":
        groups = []
        for g in state["groups"]:
            tokens, logprobs = g["tokens"].tolist(), g["logprobs"].tolist()
            starts = [sum(g["lengths"][:i]) for i in range(len(g["lengths"]))]
            groups.append(GroupInFlight(
                g["serial"], g["row"], g["prompt_ids"], g["version"],
                [tokens[a:a + n] for a, n in zip(starts, g["lengths"])],
                [logprobs[a:a + n] for a, n in zip(starts, g["lengths"])], list(g["finish_reasons"]), g["calls"]))
        return cls(groups, state["next_serial"])


def groups_batch(groups: list[GroupInFlight], pad_id: int, decode) -> Batch:
    """The delivered groups as a step's `Batch` (rows group-contiguous); `decode(rows, rollout)` the texts."""
    completions = [(g, i) for g in groups for i in range(len(g.tokens))]
    rollout = Rollout.concatenate([Rollout(
        completion_ids=torch.tensor(g.tokens[i], dtype=torch.long)[None],
        completion_mask=torch.ones((1, len(g.tokens[i])), dtype=torch.long),
        logprobs=torch.tensor(g.logprobs[i], dtype=torch.float32)[None],
        finish_reasons=[g.finish_reasons[i]]) for g, i in completions], pad_id, width=1)
    rows = [g.row for g, _ in completions]
    carried = sum(g.calls > 1 for g in groups) / len(groups)
    return Batch(rows=rows, prompt_ids=[g.prompt_ids for g, _ in completions], rollout=rollout,
                 completions=decode(rows, rollout), rollout_metrics={"async/carried_groups": carried})


class PartialRollouts:
    """A sampling rank's calls with partial rollouts, for the trainers it serves (one pool each).

    engine: the rank's `Engine`; group_sampler: its `GroupSampler` (prompt rendering, sampling settings,
    decoding); prompts_per_step: the groups each trainer trains a step."""

    def __init__(self, engine, group_sampler, group_size: int, prompts_per_step: int, max_staleness: int,
                 pad_id: int):
        self.engine, self.group_sampler, self.group_size = engine, group_sampler, group_size
        self.prompts_per_step, self.max_staleness, self.pad_id = prompts_per_step, max_staleness, pad_id

    def __call__(self, pools: list[GroupPool], new_rows: list[list[dict]], step: int, version: int,
                 seed: int) -> list[tuple[Batch, int, int]]:
        """Add each trainer's new prompts to its pool, sample until every trainer has a step's groups, and
        return per trainer (its batch, the policy version of the batch's oldest tokens, groups dropped)."""
        for pool, rows in zip(pools, new_rows):
            pool.add(rows, [self.group_sampler.encode_prompt(r["prompt"]) for r in rows], version, self.group_size)
        work = [(k, group, g) for k, pool in enumerate(pools) for group in pool.groups for g in group.unfinished()]
        if work:
            self.continue_until_enough(pools, work, step, seed)
        results = []
        for pool in pools:
            groups, dropped = pool.deliver(step, self.prompts_per_step, self.max_staleness)
            batch = groups_batch(groups, self.pad_id, self.group_sampler.decode)
            batch.rollout_metrics["async/dropped_groups"] = float(dropped)
            results.append((batch, min(g.version for g in groups), dropped))
        return results

    def continue_until_enough(self, pools: list[GroupPool], work: list, step: int, seed: int) -> None:
        params = self.group_sampler.sampling_params(seed)
        budget = params.max_new_tokens
        complete_before = [{g.serial for g in pool.groups if g.complete} for pool in pools]
        waiting = {}  # (trainer, serial) -> completions of the group not finished yet
        for k, group, _ in work:
            waiting[(k, group.serial)] = waiting.get((k, group.serial), 0) + 1

        def enough(finished) -> bool:
            left = dict(waiting)
            for seq in finished:
                k, group, _ = work[seq.index]
                left[(k, group.serial)] -= 1
            complete = [set(done) for done in complete_before]
            for (k, serial), count in left.items():
                if count == 0:
                    complete[k].add(serial)
            return all(pool.ready(done, step, self.prompts_per_step, self.max_staleness)
                       for pool, done in zip(pools, complete))

        prompts = [group.prompt_ids + group.tokens[g] for _, group, g in work]
        limits = [budget - len(group.tokens[g]) for _, group, g in work]
        sequences = self.engine.generate_until(prompts, limits, params, enough)
        for (_, group, g), seq in zip(work, sequences):
            group.tokens[g] = group.tokens[g] + seq.tokens.tolist()
            group.logprobs[g] = group.logprobs[g] + seq.logprobs.tolist()
            group.finish_reasons[g] = seq.finish_reason
        for group in {id(group): group for _, group, _ in work}.values():
            group.calls += 1


def partial_rollout_settings(args, *, engine: bool, tools: bool, routing_replay: bool = False) -> dict:
    """`partial_rollouts` and `max_staleness` as the run uses them: `auto` and an unset `max_staleness` settled,
    the same on every rank (each holds the same model and tools). Partial rollouts are on wherever they can run,
    since no sampling call then waits for its longest completion (docs/performance.md measures the gain);
    asked for where they cannot, they are refused here, on every rank alike. `engine`: the policy samples with
    cohort's engine, which can pause a call; `tools`: completions may call tools; `routing_replay`: a
    mixture-of-experts policy is trained on its sampler's routes."""
    if not engine:
        cannot = ("partial_rollouts needs cohort's engine, which can pause a call; this model samples with Hugging "
                  "Face generate: load a Llama, Mistral, Qwen2 or Qwen3 model with model_impl='cohort', or leave "
                  "partial_rollouts off")
    elif tools:
        cannot = ("partial_rollouts with tools is not supported (a paused turn's tool call would have to wait "
                  "across calls); leave one of them out")
    elif routing_replay:
        cannot = ("partial_rollouts with routing_replay is not supported (a carried group's expert routes are not "
                  "kept across calls); pass --routing_replay false or leave partial_rollouts off")
    else:
        cannot = None
    partial = args.partial_rollouts
    if partial == "auto":
        partial = bool(args.rollout_gpus and cannot is None and (args.max_staleness is None or args.max_staleness >= 2))
    elif partial and cannot is not None:
        raise CohortError(cannot)
    staleness = args.max_staleness if args.max_staleness is not None else 2 if partial else 1
    return {"partial_rollouts": partial, "max_staleness": staleness}


def partial_rollouts(args, sampler, group_sampler, pad_id: int) -> PartialRollouts | None:
    """A sampling rank's `PartialRollouts` when `args.partial_rollouts` (resolved) asks for them, else None."""
    if not args.partial_rollouts:
        return None
    return PartialRollouts(sampler, group_sampler, args.num_generations, args.prompts_per_step, args.max_staleness,
                           pad_id)
