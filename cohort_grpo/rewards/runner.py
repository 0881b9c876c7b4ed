"""Calls reward functions safely and combines them by weight (TRL's `GRPOTrainer._calculate_rewards`).

The combined reward of sample i is Σ_f w_f · r_f(i), where a function's None ("does not score this
sample") counts as 0 — TRL's `nansum` over the `[B, F]` table. A sample that no function scores is
*unscored* (`RewardOutput.unscored`, the all-NaN rows of the table): as in TRL 1.16 it is left out of
its group's baseline and gets advantage 0 (`advantages.group_advantages(scored=...)`), and out of the
`reward` / `reward_std` metrics; `rewards/unscored_frac` counts it.

Faults. A reward function that *raises* is a bug the user should hear about at once: by default
(`errors="raise"`, `--reward_errors raise`) the first exception stops the run with one line naming the
function, the exception's last line and the completion it failed on (`CohortError`). With `errors="warn"`
the samples it failed on get None (NaN in the table; unscored if no other function scores them), one
notice per function says so, and `rewards/<name>/errors` counts them in every call's metrics. A function
that hangs past `timeout_s` or returns NaN / inf is not an error by this rule: those samples get None and
a notice, once per function and kind of fault, under either setting. A contract breach that would make
every step wrong — the wrong number of values, a non-numeric value, a missing dataset column — always
raises `CohortError`. A notice is one line on stderr (`cohort: ...`) naming the function, the sample and
what becomes of it. To quote the completion a whole-batch function failed on, the function is called
again on one sample at a time (within `timeout_s` in all) until one of them raises alone.

Time limits. A whole-batch call runs in a daemon thread and is abandoned after `timeout_s` (Python
cannot kill a thread; the abandoned one runs on in the background: user_calls.py). A function that carries a
`score_sample` attribute (`accuracy_reward` does) is instead scored one sample at a time in worker
*processes* (sample_workers.py): a sample that exceeds `timeout_s` gets None and its process is killed and
replaced.
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cohort_grpo.config.choices import CHOICES
from cohort_grpo.errors import CohortError
from cohort_grpo.rewards.completions import completion_text
from cohort_grpo.rewards.rules import resolve_reward
from cohort_grpo.rewards.sample_workers import SampleWorkerPool, importable_elsewhere
from cohort_grpo.rewards.user_calls import accepted_kwargs, call_in_thread, exception_line


ERROR_POLICIES = CHOICES["reward_errors"]  # what a reward function that raises does: stop the run, or score None


@dataclass
class RewardOutput:
    rewards: torch.Tensor  # [B] float32: Σ_f w_f · r_f, a function's None counting as 0 (TRL's nansum); 0 if unscored
    per_function: torch.Tensor  # [B, F] float32, NaN where a function returned None / failed
    # rewards/<name>/mean, rewards/<name>/std (over non-NaN); reward, reward_std (over the scored samples);
    # rewards/unscored_frac (the fraction of samples no function scored); with errors="warn" also
    # rewards/<name>/errors (how many samples the function raised on in this call)
    metrics: dict[str, float]
    # TRL's log_extra(column, values): each column a reward function logged, one value per sample
    extras: dict[str, list] = field(default_factory=dict)

    @property
    def unscored(self) -> torch.Tensor:
        """[B] bool: True where no reward function scored the sample (every one returned None or failed)."""
        return unscored_rows(self.per_function)


def unscored_rows(per_function: torch.Tensor) -> torch.Tensor:
    """[B] bool from a [B, F] table of scores: True where every function's entry is NaN (not scored)."""
    return torch.isnan(per_function).all(dim=1)


_FIXED_ARGUMENTS = ("prompts", "completions", "completion_ids")
# What TRL 1.16 passes every reward function besides the columns: transformers' TrainerState, and the
# functions that log a scalar metric (averaged into the step's metrics) and an extra completions-table column.
_TRAINER_ARGUMENTS = ("trainer_state", "log_metric", "log_extra")


def _function_name(func: Callable) -> str:
    target = getattr(func, "func", func)  # functools.partial
    return getattr(target, "__name__", None) or type(target).__name__


class RewardRunner:
    """Runs a list of reward functions on a batch and combines them by weight.

    `reward_funcs` are callables or names `resolve_reward` understands; `reward_weights` default to 1.0
    each; `timeout_s` limits each whole-batch call, and each sample of a per-sample function; `errors`
    is what a function that raises does: "raise" (a `CohortError` naming it) or "warn" (its samples
    get None, counted in `rewards/<name>/errors`). `none_ok`: no functions at all is a run whose only signal is
    elsewhere (a distillation teacher's): every reward is then 0, and no sample counts as scored."""

    def __init__(self, reward_funcs: list[Callable | str], reward_weights: list[float] | None = None,
                 timeout_s: float = 10.0, sample_workers: int = 2, errors: str = "raise", none_ok: bool = False):
        if errors not in ERROR_POLICIES:
            raise CohortError(f"reward_errors={errors!r}: choose raise (stop at a reward function's first "
                              "exception) or warn (score its failed samples None) (--reward_errors)")
        self.errors = errors
        if not reward_funcs and not none_ok:
            raise CohortError("no reward functions given; name at least one (--reward_funcs), or distil from a teacher "
                              "(--teacher_model with --distillation_coef)")
        self.funcs = [resolve_reward(f) for f in reward_funcs]
        if reward_weights is None:
            reward_weights = [1.0] * len(self.funcs)
        if len(reward_weights) != len(self.funcs):
            raise CohortError(f"{len(reward_weights)} reward weights for {len(self.funcs)} reward functions; "
                              "give one weight per function (--reward_weights)")
        self.weights = torch.tensor([float(w) for w in reward_weights], dtype=torch.float32)
        if not bool(torch.isfinite(self.weights).all()):
            raise CohortError(f"reward weights must be finite numbers, got {list(reward_weights)} (--reward_weights)")
        if timeout_s is None or not timeout_s > 0:
            raise CohortError(f"reward timeout must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.names = _unique([_function_name(f) for f in self.funcs])
        self._warned: set[tuple[str, str]] = set()
        self._error_counts: dict[str, int] = {}
        self._pool = SampleWorkerPool(max(1, sample_workers), self.timeout_s, self._warn, self._raised)

    # ------------------------------------------------------------------------------------ checking

    def required_columns(self, func: Callable) -> list[str]:
        """Keyword arguments without default that the function needs beyond prompts/completions/ids."""
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):  # builtins without a signature: nothing to check
            return []
        return [p.name for p in params
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                and p.name not in _FIXED_ARGUMENTS + _TRAINER_ARGUMENTS]

    def check_columns(self, columns) -> None:
        """Raise `CohortError` when a reward function needs a dataset column that is missing. The trainer
        can call this with the dataset's column names before the first (expensive) generation."""
        available = sorted(columns)
        for name, func in zip(self.names, self.funcs):
            for column in self.required_columns(func):
                if column not in columns:
                    raise CohortError(f"reward {name!r} needs dataset column {column!r}; the dataset has "
                                      f"columns {available}; add that column to the data or drop the reward")

    # ------------------------------------------------------------------------------------- calling

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]] | None,
                 columns: dict[str, list], trainer_state=None) -> RewardOutput:
        """`trainer_state`: transformers' TrainerState the functions get as TRL's do (None outside a trainer)."""
        # TRL passes every dataset column but these; a column with one of their names would collide.
        columns = {k: v for k, v in (columns or {}).items()
                   if k not in _FIXED_ARGUMENTS + _TRAINER_ARGUMENTS + ("prompt",)}
        self.check_columns(columns)
        batch = len(completions)
        for column, values in columns.items():
            if len(values) != batch:
                raise ValueError(f"column {column!r} has {len(values)} values for {batch} completions")
        table = torch.full((batch, len(self.funcs)), float("nan"), dtype=torch.float32)
        if not self.funcs:  # nothing scores: rewards 0, every sample unscored (its advantage from the rewards 0)
            return RewardOutput(rewards=torch.zeros(batch), per_function=table, metrics={})
        nonfinite: dict[str, dict[int, float]] = {}  # each function's NaN / inf values, by sample
        self._error_counts = {name: 0 for name in self.names}
        logged: dict[str, list[float]] = {}  # log_metric's values by name, averaged into the metrics
        extras: dict[str, list] = {}  # log_extra's columns
        for j, (name, func) in enumerate(zip(self.names, self.funcs)):
            if importable_elsewhere(getattr(func, "score_sample", None)) and self._pool.available:
                values = self._pool.score(name, func.score_sample, completions, columns)
            else:
                trainer = self._trainer_arguments(name, trainer_state, logged, extras, batch)
                kwargs = accepted_kwargs(func, dict(prompts=prompts, completions=completions,
                                                     completion_ids=completion_ids, **columns, **trainer))
                values = self._call_with_timeout(name, func, kwargs, completions)
            scores, nonfinite[name] = self._check_values(name, values, batch)
            table[:, j] = torch.tensor(scores, dtype=torch.float32)
        unscored = unscored_rows(table)
        self._report_nonfinite(nonfinite, unscored, completions)
        unexplained = unscored.clone()  # a non-finite value's notice says what becomes of its sample
        unexplained[[i for samples in nonfinite.values() for i in samples]] = False
        if batch and bool(unexplained.any()):
            first = int(unexplained.nonzero()[0])
            self._warn("*", "unscored", f"no reward function scored {int(unscored.sum())} of {batch} samples; "
                       "they are left out of their group's baseline and get advantage 0", completions[first])
        rewards = (table * self.weights).nansum(dim=1)
        metrics = {**self._metrics(table, rewards, unscored), **{k: sum(v) / len(v) for k, v in logged.items()}}
        return RewardOutput(rewards=rewards, per_function=table, metrics=metrics, extras=extras)

    def _trainer_arguments(self, name: str, trainer_state, logged: dict, extras: dict, batch: int) -> dict:
        """What TRL 1.16 hands reward function `name` besides the columns: `trainer_state`, `log_metric(key, value)`
        (into `logged`, averaged into the step's metrics) and `log_extra(column, values)` (one value per sample,
        into `extras`: a column of the step's lines in completions.jsonl)."""
        def log_metric(key: str, value) -> None:
            logged.setdefault(key, []).append(float(value))

        def log_extra(column: str, values) -> None:
            values = list(values)
            if len(values) != batch:
                self._warn(name, "log_extra", f"reward {name!r} called log_extra({column!r}, ...) with {len(values)} "
                           f"values for {batch} completions; pass one per completion (that column is not logged)")
                return
            extras[str(column)] = values

        return dict(trainer_state=trainer_state, log_metric=log_metric, log_extra=log_extra)

    def _call_with_timeout(self, name, func, kwargs, completions) -> list:
        """Call `func(**kwargs)` in a daemon thread; all-None if it raises or outlives `timeout_s`."""
        box = call_in_thread(func, kwargs, self.timeout_s, f"reward-{name}")
        if box is None:
            self._warn(name, "timeout", f"reward {name!r} took longer than {self.timeout_s:g}s on a batch of "
                       f"{len(completions)}; the batch gets None for it (its thread is left running)")
            return [None] * len(completions)
        if "error" in box:
            culprit = None
            if self.errors == "raise" or (name, "raised") not in self._warned:  # only for a message shown
                culprit = self._failing_sample(func, kwargs, len(completions), box["error"])
            self._raised(name, exception_line(box["error"]), completions, culprit=culprit)
            return [None] * len(completions)
        return box["values"]

    def _failing_sample(self, func, kwargs: dict, batch: int, error: BaseException) -> int | None:
        """The first sample on which `func`, called on that sample alone, raises `error`'s type again; None
        when none does within `timeout_s` in all (the batch as a whole is what fails)."""
        deadline = time.monotonic() + self.timeout_s
        for i in range(batch):
            one = {key: [value[i]] if isinstance(value, (list, tuple)) and len(value) == batch else value
                   for key, value in kwargs.items()}
            box = call_in_thread(func, one, deadline - time.monotonic(), "reward-culprit")
            if box is None:
                return None
            if type(box.get("error")) is type(error):
                return i
        return None

    def _raised(self, name: str, error: str, completions: list, sample: int | None = None,
                culprit: int | None = None) -> None:
        """Function `name` raised `error` ("Type: last line") on one sample (`sample`), or on the whole batch
        (`culprit`: the sample that alone raises it too, if one does): a `CohortError` under errors="raise";
        else a notice (once) and the samples counted."""
        if sample is not None:
            quoted, where = sample, f"on sample {sample}"
        elif culprit is not None:
            quoted, where = culprit, f"on a batch of {len(completions)} completions, and on sample {culprit} alone"
        else:
            quoted, where = None, f"on a batch of {len(completions)} completions (no one sample raises it alone)"
        shown = f" ({_shown(completions[quoted], 80)!r})" if quoted is not None else ""
        if self.errors == "raise":
            raise CohortError(f"reward {name!r} raised {error} {where}{shown}; fix the function, or pass "
                              "--reward_errors warn to score the samples it fails on None and go on")
        self._error_counts[name] = self._error_counts.get(name, 0) + (1 if sample is not None else len(completions))
        what = "that sample gets" if sample is not None else "the batch gets"
        self._warn(name, "raised", f"reward {name!r} raised {error} {where}{shown}; {what} None for it (counted "
                   f"in rewards/{name}/errors)")

    def _report_nonfinite(self, nonfinite: dict[str, dict[int, float]], unscored: torch.Tensor,
                          completions: list) -> None:
        """One notice per function that returned NaN / inf: its first such sample, and what becomes of it."""
        for name, samples in nonfinite.items():
            if not samples:
                continue
            i = min(samples)
            fate = ("no reward function scores that sample, so it gets advantage 0 and stays out of its group's "
                    "baseline (counted in rewards/unscored_frac)" if bool(unscored[i])
                    else f"{name!r} does not score that sample, the other reward functions do")
            self._warn(name, "nan", f"reward {name!r} returned {samples[i]} for sample {i} of {len(completions)} "
                       f"({_shown(completions[i], 80)!r}): {fate}")

    def _check_values(self, name, values, batch) -> tuple[list[float], dict[int, float]]:
        """`values` as floats, NaN where None or not finite, after checking the function's contract; and the
        NaN / inf values by sample (scored None, with a notice of their own)."""
        try:
            if isinstance(values, (str, bytes, dict, set, frozenset)):  # a length, but no score per completion
                raise TypeError(type(values).__name__)
            values = list(values.tolist() if hasattr(values, "tolist") else values)
        except TypeError:
            raise CohortError(f"reward {name!r} returned a {type(values).__name__}, not a list of floats; "
                              "return one float or None per completion") from None
        if len(values) != batch:
            raise CohortError(f"reward {name!r} returned {len(values)} values for {batch} completions; "
                              "return one float or None per completion")
        out, nonfinite = [], {}
        for i, value in enumerate(values):
            if value is None:
                out.append(math.nan)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                try:
                    value = float(value)  # numpy / torch scalars
                except (TypeError, ValueError):
                    raise CohortError(f"reward {name!r} returned {value!r} ({type(value).__name__}) for sample "
                                      f"{i}; return a float or None per completion") from None
            if not math.isfinite(value):
                nonfinite[i] = float(value)
            out.append(float(value) if math.isfinite(value) else math.nan)
        return out, nonfinite

    def _metrics(self, table: torch.Tensor, rewards: torch.Tensor, unscored: torch.Tensor) -> dict[str, float]:
        metrics = {}
        for j, name in enumerate(self.names):
            mean, std = _nan_mean_std(table[:, j])
            metrics[f"rewards/{name}/mean"] = mean
            metrics[f"rewards/{name}/std"] = std
            if self.errors == "warn":
                metrics[f"rewards/{name}/errors"] = float(self._error_counts.get(name, 0))
        # As TRL: the combined reward's statistics leave the unscored samples out.
        metrics["reward"], metrics["reward_std"] = _nan_mean_std(rewards.masked_fill(unscored, math.nan))
        metrics["rewards/unscored_frac"] = float(unscored.float().mean()) if len(unscored) else 0.0
        return metrics

    def _warn(self, name: str, kind: str, message: str, completion=None) -> None:
        """One line on stderr per function and kind of fault, showing the offending completion (truncated)."""
        if (name, kind) in self._warned:
            return
        self._warned.add((name, kind))
        if completion is not None:
            message += f"; completion: {_shown(completion, 200)!r}"
        print(f"cohort: {message} (reported once; later ones are handled alike)", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the per-sample worker processes (also done at garbage collection and exit)."""
        self._pool.close()

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()


def _shown(completion, limit: int) -> str:
    text = completion_text(completion)
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} chars)"


def _unique(names: list[str]) -> list[str]:
    """Duplicates get a suffix: [f, f, g] → [f, f_2, g]."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        candidate = name if seen[name] == 1 else f"{name}_{seen[name]}"
        while candidate in out or (candidate != name and candidate in names):
            seen[name] += 1
            candidate = f"{name}_{seen[name]}"
        out.append(candidate)
    return out


def _nan_mean_std(values: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std over the non-NaN entries (std 0 for one value; NaN, NaN for none)."""
    kept = values[~torch.isnan(values)].double()
    if kept.numel() == 0:
        return math.nan, math.nan
    std = kept.std(unbiased=True).item() if kept.numel() > 1 else 0.0
    return kept.mean().item(), std
