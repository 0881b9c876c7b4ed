"""Held-out evaluation: greedy accuracy, pass@k and maj@k from sampled completions, format rate, mean length.

The same function runs inside training (every `eval_steps`, logged as `eval/accuracy`, which is the
greedy accuracy, also logged as `eval/greedy_accuracy`) and from `cohort-grpo eval`. Two different
quantities, never to be confused:

- **greedy accuracy**: one greedy (temperature 0) completion per question, scored right or wrong.
  Often called "pass@1 (greedy)"; it is the accuracy of the most likely completion, not an estimate
  of how often a *sample* is right.
- **pass@k** (with `num_samples` = n > 1): n completions per question sampled at `temperature`, and
  the unbiased estimator of Chen et al. 2021 (`passk.pass_at_k`) for k = 1, 2, 4, … up to n, and n
  itself (`passk.pass_k_values`). pass@1 is then the mean accuracy of the samples. maj@n is the
  majority-vote accuracy over the n samples (Wang et al. 2023, self-consistency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cohort_grpo.eval.passk import majority_vote, pass_at_k, pass_k_values
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.rollout.images import encode_rows
from cohort_grpo.tools.environments import reset_environments, with_addition

@dataclass
class EvalResult:
    accuracy: float  # greedy accuracy: the greedy completion is correct (also called pass@1 (greedy))
    format_rate: float  # fraction of greedy completions in the task's answer format (`task.follows_format`)
    mean_length: float  # greedy completion length in tokens
    num_questions: int
    pass_at_k: float | None = None  # pass@n, n = k = num_samples (kept for callers that read it)
    maj_at_k: float | None = None  # maj@n
    k: int = 1  # n, the samples per question (1: greedy only)
    records: list[dict] = field(default_factory=list)
    pass_at: dict[int, float] = field(default_factory=dict)  # k -> unbiased pass@k from the n samples
    temperature: float | None = None  # of the samples

    @property
    def num_samples(self) -> int:
        return self.k

    def summed(self, all_reduce_sums) -> "EvalResult":
        """The result over every rank's questions: `all_reduce_sums(list of floats)` sums each count
        over ranks (cohort_grpo/parallel/distributed.py); `records` stay this rank's own."""
        sampled = self.pass_at_k is not None
        ks = pass_k_values(self.k) if sampled else []
        mine = len(self.records)
        counts = [mine, sum(r["correct"] for r in self.records), sum(r["format_ok"] for r in self.records),
                  sum(r["length"] for r in self.records), (self.maj_at_k or 0.0) * mine,
                  *[self.pass_at.get(k, 0.0) * mine for k in ks]]
        n, correct, format_ok, length, majority, *passed = all_reduce_sums(counts)
        n_safe = max(n, 1.0)
        pass_at = {k: p / n_safe for k, p in zip(ks, passed)}
        return EvalResult(accuracy=correct / n_safe, format_rate=format_ok / n_safe, mean_length=length / n_safe,
                          num_questions=int(n), pass_at_k=pass_at.get(self.k) if sampled else None,
                          maj_at_k=majority / n_safe if sampled else None, k=self.k, records=self.records,
                          pass_at=pass_at, temperature=self.temperature)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """`{prefix}greedy_accuracy` (and its old name `{prefix}accuracy`), format rate, mean length;
        with samples `{prefix}pass@k` for each reported k and `{prefix}maj@n`."""
        out = {f"{prefix}accuracy": self.accuracy, f"{prefix}greedy_accuracy": self.accuracy,
               f"{prefix}format_rate": self.format_rate, f"{prefix}mean_length": self.mean_length}
        if self.pass_at_k is not None:
            for k, value in sorted(self.pass_at.items()):
                out[f"{prefix}pass@{k}"] = value
            out[f"{prefix}pass@{self.k}"] = self.pass_at_k
            out[f"{prefix}maj@{self.k}"] = self.maj_at_k
        return out

    def definitions(self, prefix: str = "eval/") -> dict[str, str]:
        """What each key of `metrics(prefix)` is, in words (`cohort-grpo eval` writes them into its summary)."""
        n, temperature = self.k, self.temperature
        known = {"accuracy": "the same as greedy_accuracy (the key training has always logged)",
                 "greedy_accuracy": "fraction of questions whose greedy (temperature 0) completion is correct",
                 "format_rate": "fraction of greedy completions in the task's answer format",
                 "mean_length": "mean greedy completion length in tokens"}
        out = {}
        for key in self.metrics(prefix):
            name = key[len(prefix):]
            if name == "pass@1":
                out[key] = (f"mean accuracy of the {n} samples per question at temperature {temperature:g} "
                            "(the unbiased pass@1)")
            elif name.startswith("pass@"):
                out[key] = (f"unbiased pass@{name[5:]} from {n} samples per question at temperature "
                            f"{temperature:g} (Chen et al. 2021: 1 - C(n-c, k) / C(n, k), c correct), "
                            "averaged over questions")
            elif name.startswith("maj@"):
                out[key] = f"fraction of questions whose most frequent answer among the {n} samples is correct"
            else:
                out[key] = known[name]
        return out


def _answer_of(task, text: str) -> str | None:
    extract = getattr(task, "extract_answer", None)
    if extract is None:
        from cohort_grpo.rewards.answer_extraction import extract_answer as extract
    return extract(text)


def _follows_format(task, text: str) -> bool:
    """The task's own format check (GSM8K: the strict <think>/<answer> layout); else "an answer can be
    extracted", which for tasks without a fixed layout is the best notion of format there is."""
    check = getattr(task, "follows_format", None)
    return bool(check(text)) if check is not None else _answer_of(task, text) is not None


class ToolRollout:
    """Samples with tools (a `Toolbox`): each completion its own environment and tool turns; its text to
    judge is its last turn, the answer the model gave after its tool calls."""

    def __init__(self, sampler, tokenizer, encode_prompt, toolbox):
        self.sampler, self.tokenizer, self.encode_prompt, self.toolbox = sampler, tokenizer, encode_prompt, toolbox
        self.conversations: list[list[dict]] = []

    def generate(self, rows: list[dict], n: int, params: SamplingParams):
        rows = [r for r in rows for _ in range(n)]
        environments = prompts = None
        if self.toolbox.environment_factory is not None:
            environments, additions = reset_environments(self.toolbox.environment_factory, rows)
            prompts = [with_addition(r["prompt"], a) for r, a in zip(rows, additions)]
        else:
            prompts = [r["prompt"] for r in rows]
        shared = self.toolbox.schemas() if environments is None else None  # made once, not per prompt
        ids = [self.encode_prompt(p, shared if environments is None else self.toolbox.schemas(environments[i]))
               for i, p in enumerate(prompts)]
        turns = self.toolbox.turns(self.tokenizer, len(ids), environments)
        rollout = self.sampler.generate(ids, 1, params, turns=turns)
        self.conversations = [turns.conversation(i, c[m.bool()].tolist(), t[m.bool()].tolist()) for i, (c, m, t) in
                              enumerate(zip(rollout.completion_ids, rollout.completion_mask, rollout.tool_mask))]
        return rollout

    def text(self, row: int) -> str:
        """The last assistant message's content."""
        mine = [m for m in self.conversations[row] if m.get("role") == "assistant"]
        return mine[-1].get("content", "") if mine else ""


def evaluate(sampler, tokenizer, task, rows: list[dict], encode_prompt, *, max_new_tokens: int = 256,
             num_samples: int = 1, temperature: float = 1.0, batch_size: int = 256, seed: int = 0,
             records_path: str | Path | None = None, toolbox=None, images=None) -> EvalResult:
    """Score `rows` with `task.is_correct`; `encode_prompt(prompt[, tools]) -> ids` applies the chat
    template. With a `toolbox` the model may call its tools, and the answer judged is its last turn. `images`: a
    vision-language model's prompt renderer (rollout/images.py), for rows with images."""
    eos = [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records = []
    ks = pass_k_values(num_samples) if num_samples > 1 else []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        greedy_params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=eos,
                                       pad_token_id=pad)
        sample_params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos,
                                       pad_token_id=pad, seed=seed + start)
        tool_greedy = tool_samples = None
        if toolbox is not None:
            tool_greedy, tool_samples = (ToolRollout(sampler, tokenizer, encode_prompt, toolbox) for _ in range(2))
            greedy = tool_greedy.generate(chunk, 1, greedy_params)
            samples = tool_samples.generate(chunk, num_samples, sample_params) if num_samples > 1 else None
        else:
            ids, pictures = encode_rows(chunk, encode_prompt, images)
            greedy = sampler.generate(ids, 1, greedy_params, **pictures)
            samples = sampler.generate(ids, num_samples, sample_params, **pictures) if num_samples > 1 else None
        for i, row in enumerate(chunk):
            text = _decode(tokenizer, greedy, i) if tool_greedy is None else tool_greedy.text(i)
            record = {"prompt": row["prompt"], "solution": row.get("solution"), "completion": text,
                      "correct": bool(task.is_correct(text, row)), "answer": _answer_of(task, text),
                      "format_ok": _follows_format(task, text),
                      "length": int(greedy.completion_mask[i].sum())}
            if tool_greedy is not None:
                record["conversation"] = tool_greedy.conversations[i]
            if samples is not None:
                texts = [_decode(tokenizer, samples, i * num_samples + j) if tool_samples is None else
                         tool_samples.text(i * num_samples + j) for j in range(num_samples)]
                verdicts = [bool(task.is_correct(t, row)) for t in texts]
                record.update(samples=texts, sample_correct=verdicts,
                              majority_correct=majority_vote([_answer_of(task, t) for t in texts], verdicts),
                              # pass@1 is the samples' mean accuracy (what pass_at_k(n, c, 1) = c / n computes)
                              pass_at={k: sum(verdicts) / num_samples if k == 1 else
                                       pass_at_k(num_samples, sum(verdicts), k) for k in ks})
            records.append(record)
    n = max(len(records), 1)  # a rank given no rows (more ranks than rows) reports zeros of 0 questions
    result = EvalResult(
        accuracy=sum(r["correct"] for r in records) / n,
        format_rate=sum(r["format_ok"] for r in records) / n,
        mean_length=sum(r["length"] for r in records) / n,
        num_questions=len(records), k=num_samples, records=records,
    )
    if num_samples > 1:
        result.temperature = temperature
        result.pass_at = {k: sum(r["pass_at"][k] for r in records) / n for k in ks}
        result.pass_at_k = result.pass_at[num_samples]
        result.maj_at_k = sum(r["majority_correct"] for r in records) / n
    if records_path is not None:
        Path(records_path).parent.mkdir(parents=True, exist_ok=True)
        with open(records_path, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return result


def _decode(tokenizer, rollout, row: int) -> str:
    ids = rollout.completion_ids[row][rollout.completion_mask[row].bool()]
    return tokenizer.decode(ids, skip_special_tokens=True)
