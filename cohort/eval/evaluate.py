"""Held-out evaluation: pass@1 (greedy), pass@k and maj@k, format rate, mean length.

The same function runs inside training (every `eval_steps`, logged as `eval/accuracy`) and from
`cohort eval`. Greedy decoding gives pass@1; with `num_samples` = k > 1 we also sample k
completions per question at `temperature` and report the unbiased pass@k (Chen et al. 2021)
and majority-vote accuracy maj@k (Wang et al. 2023, self-consistency).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .passk import majority_vote, pass_at_k
from ..rollout.sampler import SamplingParams


@dataclass
class EvalResult:
    accuracy: float  # pass@1, greedy
    format_rate: float  # fraction of greedy completions in the task's answer format (`task.follows_format`)
    mean_length: float  # greedy completion length in tokens
    num_questions: int
    pass_at_k: float | None = None
    maj_at_k: float | None = None
    k: int = 1
    records: list[dict] = field(default_factory=list)

    def summed(self, all_reduce_sums) -> "EvalResult":
        """The result over every rank's questions: `all_reduce_sums(list of floats)` sums each count
        over ranks (cohort/run/distributed.py); `records` stay this rank's own."""
        sampled = self.pass_at_k is not None
        counts = [len(self.records), sum(r["correct"] for r in self.records), sum(r["format_ok"] for r in self.records),
                  sum(r["length"] for r in self.records), (self.pass_at_k or 0.0) * len(self.records),
                  (self.maj_at_k or 0.0) * len(self.records)]
        n, correct, format_ok, length, passed, majority = all_reduce_sums(counts)
        n_safe = max(n, 1.0)
        return EvalResult(accuracy=correct / n_safe, format_rate=format_ok / n_safe, mean_length=length / n_safe,
                          num_questions=int(n), pass_at_k=passed / n_safe if sampled else None,
                          maj_at_k=majority / n_safe if sampled else None, k=self.k, records=self.records)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {f"{prefix}accuracy": self.accuracy, f"{prefix}format_rate": self.format_rate,
               f"{prefix}mean_length": self.mean_length}
        if self.pass_at_k is not None:
            out[f"{prefix}pass@{self.k}"] = self.pass_at_k
            out[f"{prefix}maj@{self.k}"] = self.maj_at_k
        return out


def _answer_of(task, text: str) -> str | None:
    extract = getattr(task, "extract_answer", None)
    if extract is None:
        from ..rewards.rules import extract_answer as extract
    return extract(text)


def _follows_format(task, text: str) -> bool:
    """The task's own format check (GSM8K: the strict <think>/<answer> layout); else "an answer can be
    extracted", which for tasks without a fixed layout is the best notion of format there is."""
    check = getattr(task, "follows_format", None)
    return bool(check(text)) if check is not None else _answer_of(task, text) is not None


def evaluate(sampler, tokenizer, task, rows: list[dict], encode_prompt, *, max_new_tokens: int = 256,
             num_samples: int = 1, temperature: float = 1.0, batch_size: int = 256, seed: int = 0,
             records_path: str | Path | None = None) -> EvalResult:
    """Score `rows` with `task.is_correct`; `encode_prompt(prompt) -> ids` applies the chat template."""
    eos = [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        ids = [encode_prompt(r["prompt"]) for r in chunk]
        greedy = sampler.generate(ids, 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                         eos_token_ids=eos, pad_token_id=pad))
        samples = None
        if num_samples > 1:
            samples = sampler.generate(ids, num_samples, SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, eos_token_ids=eos, pad_token_id=pad,
                seed=seed + start))
        for i, row in enumerate(chunk):
            text = _decode(tokenizer, greedy, i)
            record = {"prompt": row["prompt"], "solution": row.get("solution"), "completion": text,
                      "correct": bool(task.is_correct(text, row)), "answer": _answer_of(task, text),
                      "format_ok": _follows_format(task, text),
                      "length": int(greedy.completion_mask[i].sum())}
            if samples is not None:
                texts = [_decode(tokenizer, samples, i * num_samples + j) for j in range(num_samples)]
                verdicts = [bool(task.is_correct(t, row)) for t in texts]
                record.update(samples=texts, sample_correct=verdicts,
                              majority_correct=majority_vote([_answer_of(task, t) for t in texts], verdicts))
            records.append(record)
    n = max(len(records), 1)  # a rank given no rows (more ranks than rows) reports zeros of 0 questions
    result = EvalResult(
        accuracy=sum(r["correct"] for r in records) / n,
        format_rate=sum(r["format_ok"] for r in records) / n,
        mean_length=sum(r["length"] for r in records) / n,
        num_questions=len(records), k=num_samples, records=records,
    )
    if num_samples > 1:
        result.pass_at_k = sum(pass_at_k(num_samples, sum(r["sample_correct"]), num_samples) for r in records) / n
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
