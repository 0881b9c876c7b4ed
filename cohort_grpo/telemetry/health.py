"""`LearningHealth`: the step log's checks for a run that cannot learn, each said once, in one line, with
the option to change.

It reads each step's metrics record (the names of docs/reference.md, averaged over the ranks) and nothing
else, so a check can be tried on made-up records. A check fires when its condition holds at `WINDOW`
consecutive steps, and never again in the run (a resumed run goes on from its checkpoint's steps:
`StepReport.resumed`); a step that does not show the problem (or does not log the metric) restarts its count.

- every completion empty (`completions/empty_ratio` = 1): the model ends each answer at once;
- every completion cut at max_completion_length (`completions/clipped_ratio` = 1);
- no reward function scoring any completion (`rewards/unscored_frac` = 1: each returned None or NaN, or timed
  out): all advantages 0;
- every group's rewards equal (`frac_reward_zero_std` = 1): all advantages 0, no gradient from the reward
  (not counted while every completion is empty or none is scored: those checks name the cause);
- a reward function raising on most of its samples (`rewards/<func>/errors` over the completions a call scores,
  `generation_batch_size`);
- most tool calls failing (`tools/failure_frequency` above `MOST`);
- the KL to the reference above `KL_LIMIT`, or the clipped share of tokens above `CLIP_LIMIT`.

Why these numbers:
- `WINDOW` = 10 steps. A group's rewards are all equal by chance now and then (a problem every sample
  solves, or none does), and early steps of a hard task may score nothing: a few steps in a row say
  little. Were half the steps all-equal by chance, ten given steps would all be so once in 1024; and ten
  steps are a small share of any run worth training, so the warning still comes early.
- `MOST` = 0.5: "most calls" — more than half of a function's samples, or of the tool calls, failed.
- `KL_LIMIT` = 1 nat per token: the policy's own tokens are then e ≈ 2.7 times likelier under it than under
  the reference (a geometric mean over tokens) — a different model, not a tuned one. The bound is on the
  drift itself, so it does not scale with β: β only sets how hard the loss pulls back, which is what the
  advice changes.
  Runs that learn stay far below it (the built-in task's KL is about 0.03 at β = 0.04).
- `CLIP_LIMIT` = 0.5: a clipped token takes no gradient from its advantage. Above half, most of the
  update's tokens learn nothing from their rewards: each update leaves the trust region ε defines
  (PPO runs usually clip a few to 20 percent of tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

WINDOW = 10
MOST = 0.5
KL_LIMIT = 1.0
CLIP_LIMIT = 0.5


@dataclass(frozen=True)
class HealthOptions:
    """The run's settings the advice quotes (GRPOConfig's names)."""

    max_completion_length: int = 256
    num_generations: int = 8
    temperature: float = 1.0
    beta: float = 0.0
    learning_rate: float = 1e-6
    num_iterations: int = 1
    epsilon: float = 0.2
    tool_timeout: float = 30.0
    reward_timeout: float = 10.0
    # the completions a rank's reward functions score in one call, which `rewards/<func>/errors` counts out of
    # (dynamic sampling's rounds, each one call, average their counts)
    generation_batch_size: int = 64

    @classmethod
    def from_config(cls, args) -> "HealthOptions":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def number(record: dict, key: str) -> float | None:
    """The record's finite number under `key`, else None (not logged, null, NaN)."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class Reading:
    """One check's reading of one step: whether the step shows the problem, and the number to quote."""

    key: str  # the check, and the reward function it is about: fires once per key
    holds: bool
    value: float


@dataclass
class Streak:
    """Consecutive steps whose reading held: their steps and values."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def span(self, detail: str = "") -> str:
        """`10 steps in a row (steps 3-12, <detail>)`."""
        detail = f", {detail}" if detail else ""
        return f"{len(self.steps)} steps in a row (steps {self.steps[0]}-{self.steps[-1]}{detail})"

    def quoted(self, digits: int = 3) -> str:
        """The values held: one number when every step had it, else their range."""
        low, high = min(self.values), max(self.values)
        return f"{low:.{digits}f} at every step" if low == high else f"{low:.{digits}f} to {high:.{digits}f}"


class LearningHealth:
    """Fed each step's record (`observe`), returns the warning lines that step makes: each check at most once
    a run. `lines` holds every warning given so far."""

    def __init__(self, options: HealthOptions = HealthOptions(), window: int = WINDOW):
        self.options, self.window = options, window
        self.streaks: dict[str, Streak] = {}
        self.fired: set[str] = set()
        self.lines: list[str] = []

    @classmethod
    def from_config(cls, args) -> "LearningHealth":
        return cls(HealthOptions.from_config(args))

    def observe(self, record: dict) -> list[str]:
        """The warnings `record` (one step's metrics) completes."""
        step, lines, seen = int(record["step"]), [], set()
        for reading in self.readings(record):
            seen.add(reading.key)
            if reading.key in self.fired:
                continue
            if not reading.holds:
                self.streaks.pop(reading.key, None)
                continue
            streak = self.streaks.setdefault(reading.key, Streak())
            streak.steps.append(step)
            streak.values.append(reading.value)
            if len(streak.steps) >= self.window:
                self.fired.add(reading.key)
                lines.append("warning: " + self.message(reading.key, self.streaks.pop(reading.key)))
        for key in [key for key in self.streaks if key not in seen]:  # not logged this step: the run of steps ends
            del self.streaks[key]
        self.lines += lines
        return lines

    def readings(self, record: dict) -> Iterator[Reading]:
        empty, clipped = number(record, "completions/empty_ratio"), number(record, "completions/clipped_ratio")
        if empty is not None:
            yield Reading("empty", empty >= 1.0, empty)
        if clipped is not None:
            yield Reading("clipped", clipped >= 1.0, clipped)
        unscored = number(record, "rewards/unscored_frac")
        if unscored is not None:
            yield Reading("unscored", unscored >= 1.0, unscored)
        equal, reward = number(record, "frac_reward_zero_std"), number(record, "reward")
        if equal is not None and "distillation/reverse_kl" not in record:  # a teacher's signal is learnt from still
            named = (empty or 0.0) >= 1.0 or (unscored or 0.0) >= 1.0  # a cause another check names
            yield Reading("equal_rewards", equal >= 1.0 and not named, reward or 0.0)
        for key in record:
            errors = number(record, key) if key.startswith("rewards/") and key.endswith("/errors") else None
            if errors is not None:
                share = min(1.0, errors / max(self.options.generation_batch_size, 1))
                yield Reading("reward_errors:" + key[len("rewards/"):-len("/errors")], share > MOST, share)
        failures, calls = number(record, "tools/failure_frequency"), number(record, "tools/call_frequency")
        if failures is not None:
            yield Reading("tool_failures", failures > MOST and (calls is None or calls > 0), failures)
        kl, clip = number(record, "kl"), number(record, "clip_ratio/region_mean")
        if kl is not None:
            yield Reading("kl", kl > KL_LIMIT, kl)
        if clip is not None:
            yield Reading("clip", clip > CLIP_LIMIT, clip)

    def message(self, key: str, streak: Streak) -> str:
        kind, _, subject = key.partition(":")
        return MESSAGES[kind](self.options, streak, subject)


def empty_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"every completion was empty for {streak.span()}: the model ends each answer at once, so no reward "
            "can tell them apart. Check that each prompt ends where the model's answer starts (the chat template; "
            "for the built-in tiny models a newline, as the arithmetic task's prompts end) and read the "
            "completions in completions.jsonl")


def clipped_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"every completion was cut at max_completion_length={o.max_completion_length} for {streak.span()}: "
            "none ends on its own, so rewards that read the end of an answer never see one. Raise "
            f"--max_completion_length (now {o.max_completion_length}), or ask for shorter answers in the prompt")


def equal_rewards_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"every group's rewards were equal for {streak.span('reward ' + streak.quoted())}: every advantage is "
            "0, so the policy learns nothing from the rewards. Check that the reward functions score these "
            "completions differently (completions.jsonl shows each function's score), use prompts the model "
            f"solves sometimes, or raise --num_generations (now {o.num_generations}) or --temperature "
            f"(now {o.temperature:g})")


def unscored_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"no reward function scored any completion for {streak.span()}: each returned None or NaN for every "
            "sample, or timed out, so every advantage is 0 and the policy learns nothing. Fix the reward functions "
            "(the line above quotes a sample they left unscored; completions.jsonl shows each function's score), or "
            f"raise --reward_timeout (now {o.reward_timeout:g} s) if they time out")


def reward_errors_message(o: HealthOptions, streak: Streak, name: str) -> str:
    return (f"reward {name!r} raised on {100 * min(streak.values):.0f}% or more of its samples for {streak.span()}: "
            "those samples score None. Fix the function (the RewardWarning above quotes its error and a sample); "
            "--reward_errors raise stops at its first error")


def tool_failures_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"most tool calls failed for {streak.span('tools/failure_frequency ' + streak.quoted(2))}: the model "
            "learns from error messages. Read the tool results in completions.jsonl and fix the tool, its "
            f"arguments' schema or the prompt that describes it, or raise --tool_timeout (now {o.tool_timeout:g} s) "
            "if the calls time out")


def kl_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"the KL to the reference stayed above {KL_LIMIT:g} nat per token for "
            f"{streak.span('kl ' + streak.quoted())}: the policy drifts from the reference faster than "
            f"beta={o.beta:g} holds it. Raise --beta, or lower --learning_rate (now {o.learning_rate:g})")


def clip_message(o: HealthOptions, streak: Streak, _) -> str:
    return (f"over half the tokens were clipped for {streak.span('clip_ratio/region_mean ' + streak.quoted(2))}: "
            "they take no gradient from their advantage, each update leaves the trust region. Lower "
            f"--learning_rate (now {o.learning_rate:g}) or --num_iterations (now {o.num_iterations}), or widen "
            f"--epsilon (now {o.epsilon:g})")


MESSAGES: dict[str, Callable[[HealthOptions, Streak, str], str]] = {
    "empty": empty_message, "clipped": clipped_message, "equal_rewards": equal_rewards_message, "unscored": unscored_message,
    "reward_errors": reward_errors_message, "tool_failures": tool_failures_message, "kl": kl_message,
    "clip": clip_message,
}
