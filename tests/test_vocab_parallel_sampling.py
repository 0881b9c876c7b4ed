"""Vocabulary-parallel sampling (cohort_grpo/rollout/vocab_parallel.py) against one process.

Two processes (gloo, CPU) each hold one slice of every case's logits and call
`sample_vocab_parallel`; this process calls `sample_from_logits` on the whole logits. Tokens must
be equal, log-probs within LOGPROB_ATOL, both ranks must agree, and each case must use the number
of gathers the module's docstring promises. The worker processes are this file run as a script,
started once for the module.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cohort_grpo.rollout.sampling import filter_logits, gumbel_noise, sample_from_logits, scale_by_temperature

LOGPROB_ATOL = 1e-6
WORLD = 2

# (vocabulary, rank 0's width): even, uneven, and one where rank 1's slice is narrower than top-k.
SPLITS = {"even": (1000, 500), "uneven": (1001, 300), "narrow": (70, 58), "pow2": (192, 128)}
# top-p values off the exact cuts of uniform rows of 1000 or 1001 tokens (0.3 of 1000 tokens is
# exactly 300 tokens' mass, decided by the last bit of the sums: see the module docstring).
FILTERS = {  # (top_k, top_p, min_p)
    "plain": (0, 1.0, 0.0), "top_k5": (5, 1.0, 0.0), "top_k40": (40, 1.0, 0.0), "top_p0.9": (0, 0.9005, 0.0),
    "top_p0.99": (0, 0.99, 0.0), "min_p0.1": (0, 1.0, 0.1), "top_k20_p0.5": (20, 0.5, 0.0),
    "all_three": (30, 0.8005, 0.05), "top_p0.3": (0, 0.3005, 0.0), "top_k5_p0.6": (5, 0.6005, 0.0),
    "top_k5_p0": (5, 0.0, 0.0), "top_k12_p0.5": (12, 0.5005, 0.0),
    "top_p0.999": (0, 0.999, 0.0), "min_p_e-2": (0, 1.0, math.exp(-2)),  # threshold: row max - 2, exactly
}


def case_list() -> dict:
    """name -> (logits kind, split, batch, temperature, filter, seed, draw)."""
    cases = {}
    for split in SPLITS:
        for batch in (1, 5):
            for temperature in (0.0, 0.7, 1.0):
                for name in FILTERS if temperature > 0 else ["plain", "top_k5"]:
                    cases[f"{split}-B{batch}-t{temperature}-{name}"] = ("random", split, batch, temperature, name, 7, 3)
    for seed, draw in ((0, 0), (2**31 - 1, 11), (-5, 2)):
        for name in ("plain", "top_k40", "top_p0.9", "all_three"):
            cases[f"seed{seed}-draw{draw}-{name}"] = ("random", "uneven", 16, 0.7, name, seed, draw)
    # bf16-rounded logits: runs of equal values, cut by top-k, top-p and min-p
    for name in ("top_k5", "top_k40", "top_p0.9", "top_p0.99", "top_k20_p0.5", "all_three", "min_p0.1"):
        cases[f"bf16-ties-{name}"] = ("coarse", "even", 16, 1.0, name, 1, 0)
    # flat rows: top-p 0.99 needs most of the vocabulary, several rounds of gathers
    cases["flat-top_p0.99"] = ("flat", "uneven", 5, 1.0, "top_p0.99", 3, 1)
    cases["flat-top_p0.9"] = ("flat", "even", 5, 1.0, "top_p0.9", 3, 1)
    # slices exactly as wide as a round's lists (64, then 128): the lists are whole, with no -inf padding
    cases["flat-whole-lists-top_p0.999"] = ("flat", "pow2", 5, 1.0, "top_p0.999", 3, 1)
    # uniform rows of 70: the second slice (12 tokens) is a whole top-12 list ending in the 12th value;
    # the first (58) a whole top-p list, all at the cut value, which the cut runs past
    cases["all-equal-narrow-top_k12_p0.5"] = ("all_equal", "narrow", 4, 1.0, "top_k12_p0.5", 0, 0)
    cases["all-equal-narrow-top_p0.9"] = ("all_equal", "narrow", 4, 1.0, "top_p0.9", 0, 0)
    for name in ("top_k5", "top_k40", "top_p0.3", "top_p0.9", "top_k20_p0.5", "min_p0.1"):
        cases[f"quarter-steps-{name}"] = ("quarters", "uneven", 16, 0.7, name, 2, 0)
    cases["quarter-steps-tokens-at-the-min_p-threshold"] = ("quarters", "even", 16, 1.0, "min_p_e-2", 2, 0)
    for split in ("even", "uneven"):
        cases[f"equal-maxima-greedy-{split}"] = ("equal_maxima", split, 4, 0.0, "plain", 0, 0)
        for name in ("top_p0.3", "top_p0.9", "top_k5", "top_k5_p0.6", "top_k5_p0", "all_three"):
            cases[f"all-equal-{split}-{name}"] = ("all_equal", split, 16, 1.0, name, 0, 0)
        # every token of the first slice above every token of the second: the top-p cut inside the
        # first slice is known only once that slice's list is whole
        cases[f"two-plateaus-{split}-top_p0.3"] = ("plateaus", split, 16, 1.0, "top_p0.3", 0, 0)
        cases[f"perturbed-tie-across-ranks-{split}"] = ("perturbed_tie", split, 3, 1.0, "plain", 5, 4)
    return cases


CASES = case_list()


def case_logits(kind: str, split: str, batch: int, seed: int, draw: int) -> torch.Tensor:
    """The whole [batch, vocabulary] logits of a case (float32), the same in every process."""
    vocab, first = SPLITS[split]
    generator = torch.Generator().manual_seed(batch * 10007 + vocab)
    if kind == "random":
        return torch.randn(batch, vocab, generator=generator) * 2.0
    if kind == "coarse":  # bf16 keeps 8 bits: many tokens share a value
        return (torch.randn(batch, vocab, generator=generator) * 1.5).bfloat16().float()
    if kind == "quarters":  # a few distinct values: long runs of equal logits
        return torch.round(torch.randn(batch, vocab, generator=generator) * 4) / 4
    if kind == "plateaus":
        return torch.cat([torch.full((batch, first), 2.0), torch.full((batch, vocab - first), 1.9)], dim=1)
    if kind == "flat":
        return torch.randn(batch, vocab, generator=generator) * 0.05
    if kind == "all_equal":
        return torch.zeros(batch, vocab)
    if kind == "equal_maxima":  # the row's maximum at two or three indices, across the ranks' border
        logits = torch.randn(batch, vocab, generator=generator)
        spots = [(3, first + 2), (first - 1, first), (first + 5, vocab - 1), (0, first + 1, vocab - 2)]
        for row, where in enumerate(spots[:batch]):
            logits[row, list(where)] = 9.0
        return logits
    if kind == "perturbed_tie":  # two tokens, one each side of the border, with equal perturbed scores
        logits = torch.full((batch, vocab), -40.0)
        noise = gumbel_noise(torch.tensor(seed), torch.tensor(draw), torch.arange(batch), vocab)
        for row in range(batch):
            a, b, l_b = tied_pair(noise[row], first, row)
            logits[row, a], logits[row, b] = 0.0, l_b
        return logits
    raise AssertionError(kind)


def tied_pair(noise: torch.Tensor, first: int, offset: int) -> tuple[int, int, float]:
    """Tokens a < first <= b and a logit l_b with l_b + g_b == 0 + g_a in float32 (g the noise)."""
    for b in range(first + offset, first + offset + 200):
        a = first - 1 - (b - first) % first
        target, l_b = noise[a], (noise[a] - noise[b]).reshape(1)
        for _ in range(4):  # a float32 ulp at a time towards the target; some pairs never land on it
            total = l_b + noise[b]
            if total == target:
                return a, b, l_b.item()
            l_b = torch.nextafter(l_b, torch.tensor([math.inf if total < target else -math.inf]))
    raise AssertionError("no pair of tokens with equal perturbed scores")


def case_arguments(name: str):
    kind, split, batch, temperature, filter_name, seed, draw = CASES[name]
    top_k, top_p, min_p = FILTERS[filter_name]
    logits = case_logits(kind, split, batch, seed, draw)
    keys = dict(seed=torch.tensor(seed), draw=torch.tensor(draw), rows=torch.arange(batch) + 3)
    return logits, split, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, **keys)


def worker(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: every case's slice through sample_vocab_parallel; results to out_dir/rank{rank}.json."""
    import torch.distributed as dist

    from cohort_grpo.rollout import vocab_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    gathers = []
    plain_gather = vocab_parallel.gather_from_ranks

    def counted_gather(local, group):
        gathers.append(list(local.shape))
        return plain_gather(local, group)

    vocab_parallel.gather_from_ranks = counted_gather
    kept = []
    plain_filter = vocab_parallel.filtered_tokens

    def recorded_filter(scaled, *args):
        keep, logsumexp = plain_filter(scaled, *args)
        kept.append(keep)
        return keep, logsumexp

    vocab_parallel.filtered_tokens = recorded_filter
    results = {}
    for name in CASES:
        logits, split, arguments = case_arguments(name)
        vocab, first = SPLITS[split]
        start, stop = (0, first) if rank == 0 else (first, vocab)
        gathers.clear()
        kept.clear()
        tokens, logprobs = vocab_parallel.sample_vocab_parallel(
            logits[:, start:stop].clone(), **arguments, vocab_start=start, vocab_size=vocab)
        results[name] = dict(tokens=tokens.tolist(), logprobs=logprobs.tolist(), gathers=list(gathers),
                             dtypes=[str(tokens.dtype), str(logprobs.dtype)],
                             kept=[(row.nonzero().flatten() + start).tolist() for row in kept[0]] if kept else None)
    vocab_parallel.check_vocab_slices(rank * 10, 10, 20)  # they tile: no error
    try:  # slices that leave a hole: every rank refuses
        vocab_parallel.check_vocab_slices(rank * 11, 10, 21)
        results["bad-slices"] = None
    except ValueError as error:
        results["bad-slices"] = str(error)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results, from one run of two worker processes."""
    root = tmp_path_factory.mktemp("vocab_parallel")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    workers = [subprocess.Popen([sys.executable, __file__, str(rank), str(root / "init"), str(root)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(WORLD)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), "\n".join(outputs)[-4000:]
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("name", list(CASES))
def test_same_tokens_and_logprobs_as_one_process(ranks, name):
    logits, _, arguments = case_arguments(name)
    tokens, logprobs = sample_from_logits(logits, **arguments)
    first, second = ranks
    assert first[name]["tokens"] == second[name]["tokens"] and first[name]["logprobs"] == second[name]["logprobs"]
    assert first[name]["dtypes"] == [str(tokens.dtype), str(logprobs.dtype)]
    assert first[name]["tokens"] == tokens.tolist()
    torch.testing.assert_close(torch.tensor(first[name]["logprobs"]), logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("name", list(CASES))
def test_gathers_per_step_are_as_documented(ranks, name):
    kind, split, batch, temperature, filter_name, _, _ = CASES[name]
    top_k, top_p, min_p = FILTERS[filter_name]
    shapes = ranks[0][name]["gathers"]
    if temperature == 0 or (top_k == 0 and top_p == 1.0 and min_p == 0):
        assert shapes == [[batch, 5]]
    elif top_k > 0:
        assert shapes == [[batch, top_k + 3], [batch, 5]]  # the last: best draw, kept log-sum-exp
    elif top_p < 1.0:
        vocab, first = SPLITS[split]
        assert shapes[0] == [batch, min(64, vocab) + 3] and shapes[-1] == [batch, 5]
        counts = [shape[1] - 1 for shape in shapes[1:-1]]  # each round doubles, until the lists are whole slices
        assert counts == [min(64 * 2**i, vocab) for i in range(1, len(counts) + 1)]
        if len(counts) >= 2:  # no round after the lists were whole slices
            assert counts[-2] < max(first, vocab - first)
        if kind in ("flat", "plateaus"):  # the rounds are exercised
            assert len(counts) >= (2 if vocab >= 1000 else 1)
    else:
        assert shapes == [[batch, 2], [batch, 5]]



@pytest.mark.parametrize("name", [name for name in CASES if CASES[name][3] > 0 and CASES[name][4] != "plain"])
def test_same_tokens_kept_by_the_filters_as_one_process(ranks, name):
    logits, _, arguments = case_arguments(name)
    scaled = scale_by_temperature(logits, arguments["temperature"])
    expected = filter_logits(scaled, arguments["top_k"], arguments["top_p"], arguments["min_p"]) > -math.inf
    kept = [sorted(ranks[0][name]["kept"][row] + ranks[1][name]["kept"][row]) for row in range(len(logits))]
    assert kept == [row.nonzero().flatten().tolist() for row in expected]


def test_slices_that_do_not_tile_the_vocabulary_are_refused_on_every_rank(ranks):
    assert all("do not tile a vocabulary of 21" in (rank["bad-slices"] or "") for rank in ranks)


def test_noise_of_a_slice_is_the_whole_vocabulary_noise_of_those_columns():
    seed, draw, rows = torch.tensor(9), torch.tensor([0, 4, 7]), torch.tensor([2, 0, 5])
    whole = gumbel_noise(seed, draw, rows, 1001)
    for start, width in ((0, 300), (300, 701), (999, 2), (17, 64)):
        assert torch.equal(gumbel_noise(seed, draw, rows, width, start), whole[:, start:start + width])


def test_top_p_keeps_the_lowest_indices_of_a_run_of_equal_logits():
    from cohort_grpo.rollout.sampling import top_p_filter

    kept = top_p_filter(torch.zeros(1, 50), 0.51) > -math.inf  # each token 0.02: 26 make 0.52
    assert kept[0].nonzero().flatten().tolist() == list(range(26))


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
