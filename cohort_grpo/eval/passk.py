"""pass@k and maj@k: how often k samples of a model solve a problem.

pass@k (Kulal et al. 2019; unbiased estimator from Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", §2.1 and Figure 3): draw n ≥ k samples per problem, count the c correct ones, and
estimate the probability that at least one of k samples is correct as

    pass@k = 1 - C(n - c, k) / C(n, k)

i.e. one minus the chance that a random k-subset of the n samples holds no correct one. It is unbiased
for every k ≤ n, unlike 1 - (1 - c/n)^k. Worked example: n = 4 samples, c = 1 correct, k = 2:
C(3, 2) / C(4, 2) = 3 / 6, so pass@2 = 0.5 — of the six pairs of samples, three contain the correct one.

maj@k (majority voting, "self-consistency": Wang et al. 2023, "Self-Consistency Improves Chain of
Thought Reasoning in Language Models"; reported as maj@k by Lewkowycz et al. 2022, Minerva, and
DeepSeekMath 2024): take the most frequent final answer among k samples; the problem counts as solved
when that answer is correct.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from cohort_grpo.errors import CohortError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, Figure 3's numerically stable form:
    C(n-c, k) / C(n, k) = Π_{i=n-c+1}^{n} (1 - k / i)).

    >>> pass_at_k(4, 1, 2)  # three of the six pairs hold the correct sample
    0.5
    >>> pass_at_k(5, 0, 3), pass_at_k(5, 3, 3)  # none correct; too few wrong ones to fill a 3-subset
    (0.0, 1.0)
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise CohortError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or k < 1 or not 0 <= c <= n:
        raise CohortError(f"pass_at_k needs n ≥ 1, k ≥ 1 and 0 ≤ c ≤ n, got n={n}, c={c}, k={k}")
    if k > n:
        raise CohortError(f"pass@{k} needs at least {k} samples per problem, got {n}; "
                          f"lower k or raise the number of samples")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    no_correct = 1.0
    for i in range(n - c + 1, n + 1):
        no_correct *= 1.0 - k / i
    return 1.0 - no_correct


def pass_k_values(n: int) -> list[int]:
    """The k that `cohort-grpo eval` reports pass@k for from n samples per problem: 1, 2, 4, … up to n, and n.

    >>> pass_k_values(1), pass_k_values(4), pass_k_values(10)
    ([1], [1, 2, 4], [1, 2, 4, 8, 10])
    """
    if not isinstance(n, int) or n < 1:
        raise CohortError(f"pass_k_values needs n ≥ 1 samples, got {n!r}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else ks + [n]


def majority_vote(answers: Sequence[str | None], verdicts: Sequence[bool]) -> bool:
    """maj@k correctness of one problem from its k samples.

    `answers[i]` is sample i's final answer in a normal form (e.g. `cohort_grpo.rewards.grading.
    canonical_answer`, so "18.00" and "$18" vote together), None when it gave none; `verdicts[i]`
    is whether sample i is correct. The most frequent non-None answer wins; ties go to the answer that
    appeared first; the problem is solved when the winner's sample is correct. No answers: not solved.

    Worked example: answers ["18", "20", "18", None], verdicts [True, False, True, False]: "18" has two
    votes, "20" one, so the vote picks "18", which is correct → True. With answers ["20", "18", None, "20"]
    the vote picks "20" → False, even though one sample was right (that sample still counts for pass@k).
    """
    if len(answers) != len(verdicts):
        raise CohortError(f"majority_vote got {len(answers)} answers but {len(verdicts)} verdicts")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    first_seen = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            first_seen.setdefault(answer, i)
    winner = max(votes, key=lambda a: (votes[a], -first_seen[a]))
    return bool(verdicts[first_seen[winner]])
