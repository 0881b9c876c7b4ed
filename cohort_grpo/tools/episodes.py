"""`EpisodeTurns`: multi-turn rollouts where an environment, not a tool call, speaks between the model's turns.

An environment library (verifiers, OpenEnv) runs each completion as an episode: the model writes a turn,
the environment answers with messages (or ends the episode), the model goes on. Each episode is a
coroutine on the tool loop (`tool_loop`); it waits for the model's turns (`Episode.model_turn`) and hands
the environment's messages back (`Episode.send`), which are rendered with the chat template as the
text that follows the model's turn, tokenised on their own and appended (the engine never re-encodes the
model's tokens). Appended tokens are masked out of the loss like tool results (cohort_grpo/rollout/turns.py).

An environment factory opts in with an `episode_turns(tokenizer, environments, template_kwargs)` method
returning an `EpisodeTurns`; the `Toolbox` asks it for the rollout's turn handler instead of making
tool turns. An episode that fails (its coroutine raises anything but a `CohortError`) ends there: it
is counted in `env/faults` and its environment keeps what reward it had (0 unless set), never the run.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Awaitable, Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.tools.turns import appended_text, tool_loop

EPISODE_END_TIMEOUT_S = 60.0  # an episode's wait for its environment after the model's last turn


class EpisodeOver(Exception):
    """The model has no turn left (the completion ended): the episode must finish."""


class Episode:
    """One completion's exchange with its environment, seen from the environment's coroutine."""

    def __init__(self, turns: "EpisodeTurns", index: int, prompt: list[dict]):
        self.turns, self.index = turns, index
        self.history = [dict(m) for m in prompt]  # the conversation so far as plain messages
        self.completion: list[dict] = []  # what follows the prompt: the model's turns and the environment's
        self.model_turns = 0
        self.delivered = 0  # model turns handed to the coroutine
        self.next_turn: Future = Future()  # (text, last) of the model's next turn, set from the engine's thread
        self.reply: Future | None = None  # what the engine waits on: tokens to append, or None to finish
        self.fault: str | None = None
        self.last_turn_seen = False  # the model's last turn has reached the environment
        self.done = False

    async def model_turn(self) -> tuple[str, bool]:
        """The model's next turn: (its text, whether it is the completion's last: no room or no answer asked)."""
        text, last = await asyncio.wrap_future(self.next_turn)
        self.last_turn_seen = last
        if text is None:
            raise EpisodeOver
        message = {"role": "assistant", "content": text}
        self.history.append(message)
        self.completion.append(message)
        self.model_turns += 1
        return text, last

    def send(self, messages: list[dict]) -> None:
        """The environment's messages after the model's turn: appended, and the model continues after them."""
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids = self.turns.appended_ids(self.history, messages)
        self.history.extend(messages)
        self.completion.extend(messages)
        self.next_turn = Future()  # before the engine can answer with the next turn
        reply, self.reply = self.reply, None
        if reply is not None and not reply.done():
            reply.set_result(ids)

    def deliver(self, text: str | None, last: bool) -> None:
        if not self.next_turn.done():
            self.delivered += 1
            self.next_turn.set_result((text, last))

    def finish(self, error: BaseException | None) -> None:
        """The coroutine is over: the engine's wait (if any) ends the completion; a failure is a fault."""
        self.done = True
        if error is not None and not isinstance(error, (EpisodeOver, asyncio.CancelledError)):
            self.fault = f"{type(error).__name__}: {error}"
        reply, self.reply = self.reply, None
        if reply is not None and not reply.done():
            if isinstance(error, CohortError):
                reply.set_exception(error)
            else:
                reply.set_result(None)


class EpisodeTurns:
    """A `cohort_grpo.rollout.turns.TurnHandler` over episodes. `play(episode, environment)` is the adapter's
    coroutine for one completion; `environments` are the rollout's, one per completion, each reset on its row
    (its `prompt`, chat messages, read from `environment.prompt`)."""

    def __init__(self, tokenizer, environments: list, play: Callable[[Episode, object], Awaitable[None]],
                 template_kwargs: dict | None = None, metric_prefix: str = "env"):
        self.tokenizer, self.template_kwargs, self.prefix = tokenizer, dict(template_kwargs or {}), metric_prefix
        eos = tokenizer.eos_token
        self.eos_text = eos if isinstance(eos, str) and eos else None
        self.episodes = [Episode(self, i, env.prompt) for i, env in enumerate(environments)]
        self.runs = [asyncio.run_coroutine_threadsafe(self.run(ep, env, play), tool_loop())
                     for ep, env in zip(self.episodes, environments)]

    @staticmethod
    async def run(episode: Episode, environment, play) -> None:
        try:
            await play(episode, environment)
        except BaseException as error:  # noqa: BLE001 - an episode's failure is that episode's, counted
            episode.finish(error)
            if isinstance(error, CohortError):
                raise
            return
        episode.finish(None)

    # ---- the engine's side ---------------------------------------------------------------------------------
    def end_of_turn(self, index: int, completion: list[int], turn_start: int):
        episode = self.episodes[index]
        if episode.done:
            return None
        reply = Future()
        episode.reply = reply
        episode.deliver(self.text(completion[turn_start:]), last=False)
        if episode.done and not reply.done():  # it ended between the check and the handover
            reply.set_result(None)
        return reply

    def close(self) -> None:
        pass

    def conversation(self, index: int, ids: list[int], sampled: list[int]) -> list[dict]:
        """Completion `index` as chat messages once its episode is over: the model's turns and the
        environment's messages. The engine ends a completion without asking when its budget runs out; its
        last turn reaches the episode here, marked as the last."""
        episode = self.episodes[index]
        segments = model_segments(ids, sampled)
        if not episode.done:
            last = segments[episode.delivered] if len(segments) > episode.delivered else None
            episode.deliver(None if last is None else self.text(last), last=True)
            try:
                self.runs[index].result(timeout=EPISODE_END_TIMEOUT_S)
            except CohortError:
                raise
            except Exception as error:  # noqa: BLE001 - an environment that does not finish is a fault
                self.runs[index].cancel()
                episode.fault = episode.fault or f"{type(error).__name__}: {error}"
                episode.done = True
        return list(episode.completion)

    def metrics(self, num_completions: int) -> dict[str, float]:
        """`env/faults` (episodes that failed, counted) and `env/turns` (the model's turns per completion)."""
        episodes = self.episodes[:num_completions]
        return {f"{self.prefix}/faults": float(sum(e.fault is not None for e in episodes)),
                f"{self.prefix}/turns": sum(e.model_turns for e in episodes) / max(len(episodes), 1)}

    # ---- rendering ---------------------------------------------------------------------------------------
    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def appended_ids(self, history: list[dict], messages: list[dict]) -> list[int]:
        """The tokens the chat template writes after the model's last turn: `messages` and the opening of the
        next assistant turn (and what follows the model's end-of-turn token, such as Qwen's newline)."""
        text = appended_text(self.tokenizer.apply_chat_template, history, messages, self.eos_text,
                             "the environment's turn", "use a chat model's template", **self.template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def model_segments(ids: list[int], sampled: list[int]) -> list[list[int]]:
    """The model's turns in a completion: the runs of sampled tokens."""
    segments, current = [], []
    for token, mine in zip(ids, sampled):
        if mine:
            current.append(token)
        elif current:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    return segments
