"""Multi-turn rollouts: what happens when a sequence ends a turn before its completion budget is spent.

The engine knows tokens, not tools. When a sequence stops (EOS, or a stop string) with budget left, it
asks a `TurnHandler` what comes next: nothing (the completion is finished), or tokens to append that the
model did not sample (a tool's result rendered as the chat template's tool turn, and the opening of the
next assistant turn), after which the model goes on from there. The handler may answer later (a
`Future`): the sequence leaves the decode batch meanwhile and its slot serves others; when the answer
comes it rejoins the batch, its KV row rebuilt from its token ids. Earlier turns are never re-tokenised:
the context is the exact ids sampled and appended so far.

Appended tokens are part of the completion (they are in `completion_ids` and count toward
`max_new_tokens`) but not the model's: `Rollout.tool_mask` is 0 on them, so the loss, KL, entropy and
length normalisation leave them out (TRL's `tool_mask`), and their sampling log-probs are 0.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Protocol, Union

import torch

# Each turn after the first draws its sampling noise under a key of its own (sequence key + turn × this),
# so a continuation never reuses the noise of the sequence's earlier tokens.
TURN_NOISE_STRIDE = 1_000_003

Continuation = Union[list[int], None]


class TurnHandler(Protocol):
    def end_of_turn(self, index: int, completion: list[int], turn_start: int) -> Continuation | Future:
        """Sequence `index` (its row in the call's Rollout) ended a turn. `completion` is every completion
        token so far (earlier turns, appended tokens and this turn); the turn the model just sampled is
        `completion[turn_start:]`. Return None (or a Future of None) to finish the sequence, or the token
        ids to append (possibly as a Future, resolved on another thread) to let the model continue."""
        ...

    def close(self) -> None:
        """The call is over (every sequence finished): release what the call held."""
        ...


class TurnKeeper:
    """The engine's side of one multi-turn `generate()` call: asks the handler what follows each
    finished turn, and turns the answer into either the sequence's final completion or its next turn
    (queued again, its context = prompt + everything so far). `requeue` gives a sequence back to the
    scheduler."""

    def __init__(self, handler: TurnHandler, requeue):
        self.handler, self.requeue = handler, requeue
        self.pending: dict[Future, object] = {}  # a handler's unanswered Future -> its sequence
        self.turns_continued = 0

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def turn_ended(self, seq) -> None:
        """`seq` finished a turn (its `tokens`, `logprobs`, `finish_reason` are this turn's)."""
        if seq.turn == 0:
            seq.budget, seq.prompt_length = seq.limit, len(seq.prompt)
        earlier = seq.earlier or []
        completion = earlier + seq.tokens.tolist()
        if seq.finish_reason != "stop" or len(completion) >= seq.budget:
            self.finalize(seq)
            return
        answer = self.handler.end_of_turn(seq.index, completion, len(earlier))
        if isinstance(answer, Future):
            if answer.done():
                self.resume(seq, answer.result())
            else:
                self.pending[answer] = seq
        else:
            self.resume(seq, answer)

    def poll(self, block: bool) -> None:
        """Resume the sequences whose handler has answered; with `block`, wait for at least one."""
        if not self.pending:
            return
        if block:
            wait(list(self.pending), return_when=FIRST_COMPLETED)
        for future in [f for f in self.pending if f.done()]:
            self.resume(self.pending.pop(future), future.result())

    def resume(self, seq, appended: Continuation) -> None:
        """Append the handler's tokens and queue the sequence's next turn, or finish it."""
        if appended is None:
            self.finalize(seq)
            return
        turn = seq.tokens.tolist()
        earlier = (seq.earlier or []) + turn
        room = seq.budget - len(earlier)
        appended = [int(t) for t in appended][:room]  # appended tokens count toward the completion budget
        seq.earlier = earlier + appended
        seq.earlier_logprobs = (seq.earlier_logprobs or []) + seq.logprobs.tolist() + [0.0] * len(appended)
        seq.earlier_sampled = (seq.earlier_sampled or []) + [1] * len(turn) + [0] * len(appended)
        if len(seq.earlier) >= seq.budget:  # no room left for the model: the completion ends here
            seq.tokens, seq.logprobs = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float32)
            self.finalize(seq, "length")
            return
        seq.prompt = seq.prompt[:seq.prompt_length] + seq.earlier
        seq.limit = seq.budget - len(seq.earlier)
        seq.turn += 1
        seq.generated = seq.stop_checked_upto = 0
        seq.tokens = seq.logprobs = seq.finish_reason = None
        self.turns_continued += 1
        self.requeue(seq)

    @staticmethod
    def finalize(seq, reason: str | None = None) -> None:
        """The sequence's whole completion: earlier turns and appended tokens, then its last turn."""
        earlier = seq.earlier or []
        seq.sampled = torch.tensor((seq.earlier_sampled or []) + [1] * len(seq.tokens), dtype=torch.long)
        seq.tokens = torch.cat([torch.tensor(earlier, dtype=torch.long), seq.tokens.long()])
        seq.logprobs = torch.cat([torch.tensor(seq.earlier_logprobs or [], dtype=torch.float32), seq.logprobs.float()])
        if reason is not None:
            seq.finish_reason = reason

