"""pass@k and maj@k (cohort_grpo/eval/passk.py) against brute-force enumeration."""

import itertools
import random

import pytest

from cohort_grpo.errors import CohortError
from cohort_grpo.eval.passk import majority_vote, pass_at_k, pass_k_values


def brute_force_pass_at_k(n, c, k):
    """The fraction of k-subsets of n samples (c of them correct) that hold at least one correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def subset_pass_at_k(verdicts, k):
    """pass@k of one problem straight from its sample verdicts: the share of the k-subsets of the
    samples (by position, so equal verdicts count separately) that hold a correct sample."""
    subsets = list(itertools.combinations(verdicts, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_of_random_verdict_lists():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 10)
        verdicts = [rng.random() < rng.random() for _ in range(n)]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(verdicts), k) == pytest.approx(subset_pass_at_k(verdicts, k), abs=1e-12)
        assert pass_at_k(n, sum(verdicts), 1) == pytest.approx(sum(verdicts) / n, abs=1e-15)  # the samples' mean


@pytest.mark.parametrize("n, ks", [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]),
                                   (8, [1, 2, 4, 8]), (16, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 20])])
def test_pass_k_values_are_powers_of_two_and_n(n, ks):
    assert pass_k_values(n) == ks


@pytest.mark.parametrize("n", [0, -1, 2.0])
def test_pass_k_values_rejects_bad_n(n):
    with pytest.raises(CohortError):
        pass_k_values(n)


def test_pass_at_1_is_the_fraction_correct_and_worked_example():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # the docstring's worked example


def test_pass_at_k_is_stable_for_large_n():
    # 1 - C(190, 10)/C(200, 10) in exact integers vs the product form
    from math import comb

    exact = 1 - comb(190, 10) / comb(200, 10)
    assert pass_at_k(200, 10, 10) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 5, 2), (0, 0, 1), (4, 1, 0), (4, -1, 1)])
def test_pass_at_k_rejects_bad_input(n, c, k):
    with pytest.raises(CohortError):
        pass_at_k(n, c, k)


def brute_force_majority(answers, verdicts):
    """Independent maj@k: count votes by scanning; ties broken by first appearance."""
    best, best_votes = None, 0
    for i, a in enumerate(answers):
        if a is None or a in answers[:i]:
            continue
        votes = answers.count(a)
        if votes > best_votes:
            best, best_votes = i, votes
    return False if best is None else verdicts[best]


def test_majority_vote_examples():
    assert majority_vote(["18", "20", "18", None], [True, False, True, False]) is True
    assert majority_vote(["20", "18", None, "20"], [False, True, False, False]) is False
    assert majority_vote([None, None], [False, False]) is False
    assert majority_vote(["7", "8"], [False, True]) is False  # tie: the first answer wins
    assert majority_vote(["8", "7"], [True, False]) is True


def test_majority_vote_matches_brute_force_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 8)
        gold = "3"
        answers = [rng.choice(["1", "2", "3", None]) for _ in range(k)]
        verdicts = [a == gold for a in answers]
        assert majority_vote(answers, verdicts) == brute_force_majority(answers, verdicts), answers


def test_majority_vote_length_mismatch():
    with pytest.raises(CohortError, match="2 answers but 1 verdicts"):
        majority_vote(["1", "2"], [True])
