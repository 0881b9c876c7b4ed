"""The engine on tensor-parallel shards (cohort_grpo/rollout/token_sampler.py): 2 gloo ranks on the CPU, in float32,
each running `Engine(shard)`, give the rollouts `Engine(full model)` gives in one process (tokens equal,
log-probs within TOLERANCE), the same on both ranks, sampling over their vocabulary slices.

The models: the built-in tiny model (grouped-query attention, tied embeddings, a vocabulary of 83 that 2 does
not divide, so the last slice is padded) and a random GQA Llama. The cases cover greedy, temperature, top-k,
top-p without top-k (decoded eagerly on a shard: it reads the host), min-p, shared prompts, continuous
batching, EOS, stop strings and `generate_until`. The ranks are started once for the module: each runs every
case and saves its results; the parent runs the same cases on the full models and compares.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, ModelConfig, from_pretrained
from cohort_grpo.models.tensor_parallel import TensorParallelCausalLM, shard_model
from cohort_grpo.rollout import Engine, SamplingParams
from cohort_grpo.rollout.sampling import sample_from_logits
from cohort_grpo.rollout.token_sampler import graph_capturable, token_sampler
from test_tensor_parallel_model import saved_model

TOLERANCE = 1e-5
WORLD = 2
GQA = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
PROMPTS = [[5, 9, 2, 7, 1, 30, 4], [11, 3], [8, 8, 20, 6, 2], [40, 1, 1, 17, 2, 9, 12, 3, 5], [2, 33, 7]]


class Letters:
    """A tokenizer for stop strings: token t decodes to one letter."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("abcdefghijklmnopqrstuvwxyz"[t % 26] for t in ids)


class CountingGraphs:
    """The engine's DecodeGraphs, counting the decode steps that go through them."""

    def __init__(self, graphs):
        self.inner, self.calls = graphs, 0

    def __call__(self, *key):
        self.calls += 1
        return self.inner(*key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def params(**options) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 10, "seed": 3, **options})


def run_cases(model, eos: list[int], stop: str) -> dict:
    """Every case's rollout on `model` (a full model or a shard), as plain tensors and lists."""
    model.fuse_projections()  # what the engine does on CUDA; a shard fuses its column-parallel projections only
    results = {}

    def record(name, engine, *args, until=False):
        engine.graphs = CountingGraphs(engine.graphs)
        if until:
            sequences = engine.generate_until(*args)
            results[name] = dict(ids=[s.tokens for s in sequences], logprobs=[s.logprobs for s in sequences],
                                 finish=[s.finish_reason for s in sequences])
        else:
            rollout = engine.generate(*args)
            results[name] = dict(ids=rollout.completion_ids, logprobs=rollout.logprobs,
                                 mask=rollout.completion_mask, finish=rollout.finish_reasons)
        results[name]["graph_steps"] = engine.graphs.calls
        engine.graphs = engine.graphs.inner

    engine = Engine(model, tokenizer=Letters(), check_interval=3)
    for name, options in {"greedy": dict(temperature=0.0), "temperature1": {}, "top_k": dict(temperature=0.8, top_k=5),
                          "top_p": dict(top_p=0.9), "min_p": dict(min_p=0.1),
                          "top_k_top_p_min_p": dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
                          "eos": dict(eos_token_ids=eos), "stop_string": dict(stop=[stop])}.items():
        record(name, engine, PROMPTS, 1, params(**options))
    record("shared_prompts", engine, PROMPTS[:2], 3, params(seed=4, top_p=0.95))
    batching = Engine(model, max_batch_size=3, check_interval=2)
    batching.bucketed = True  # the graph mode's padded widths and KV lengths, without CUDA
    record("continuous_batching", batching, PROMPTS, 2, params(seed=5, eos_token_ids=eos))
    until = Engine(model, max_batch_size=2, check_interval=2)
    record("generate_until", until, PROMPTS, [10, 3, 8, 2, 10], params(seed=6),
           lambda finished: len(finished) >= 2, until=True)
    return results


def run_rank(rank: int, folder: str, names: list[str], eos: list[int], stop: str) -> None:
    """One of the two ranks: each model's shard runs every case; its results are saved."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        for name in names:
            torch.save(run_cases(shard_model(saved_model(folder, name)), eos, stop),
                       os.path.join(folder, f"{name}-rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other still uses it (std::terminate in its threads)
    finally:
        dist.destroy_process_group()


def random_model(config: ModelConfig) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def cases(tiny_dir, tmp_path_factory):
    """name -> (the full model's results, [rank 0's, rank 1's])."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("tensor_parallel_engine")
    models = {"tiny": from_pretrained(tiny_dir), "gqa": random_model(GQA)}
    # EOS ids and a stop string that the completions reach early: taken from a plain run's tokens
    plain = Engine(models["tiny"]).generate(PROMPTS, 1, params()).completion_ids
    eos, stop = sorted({int(plain[row, 2]) for row in range(3)}), Letters().decode(plain[0, 3:5].tolist())
    for name, model in models.items():
        torch.save({"config": model.config, "state": model.state_dict()}, folder / f"{name}.pt")
    mp.spawn(run_rank, args=(str(folder), list(models), eos, stop), nprocs=WORLD, join=True)
    return {name: (run_cases(model, eos, stop), [torch.load(folder / f"{name}-rank{r}.pt") for r in range(WORLD)])
            for name, model in models.items()}


CASE_NAMES = ["greedy", "temperature1", "top_k", "top_p", "min_p", "top_k_top_p_min_p", "eos", "stop_string",
              "shared_prompts", "continuous_batching", "generate_until"]
TOP_P_WITHOUT_TOP_K = {"top_p", "shared_prompts"}


def as_list(value):
    return value if isinstance(value, list) else [value]


@pytest.mark.cpu("float32 CPU numbers of two gloo ranks against one process")
@pytest.mark.parametrize("model", ["tiny", "gqa"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_shards_sample_the_full_models_rollouts(cases, model, case):
    expected, ranks = cases[model][0][case], [r[case] for r in cases[model][1]]
    for got in ranks:
        assert got["finish"] == expected["finish"]
        for key in ("ids", "mask"):
            for g, e in zip(as_list(got.get(key, [])), as_list(expected.get(key, []))):
                assert torch.equal(g, e), key
        for g, e in zip(as_list(got["logprobs"]), as_list(expected["logprobs"])):
            assert g.shape == e.shape and torch.allclose(g, e, rtol=0.0, atol=TOLERANCE)
    first, second = ranks
    assert first["finish"] == second["finish"]
    for key in ("ids", "logprobs", "mask"):
        for a, b in zip(as_list(first.get(key, [])), as_list(second.get(key, []))):
            assert torch.equal(a, b), key
    # top-p without top-k reads the host on a shard: its decode steps bypass the CUDA graphs
    assert expected["graph_steps"] > 0
    assert all((r["graph_steps"] == 0) == (case in TOP_P_WITHOUT_TOP_K) for r in ranks)


def test_the_cases_stop_early_as_intended(cases):
    results = cases["tiny"][0]
    assert "stop" in results["eos"]["finish"] and "stop" in results["continuous_batching"]["finish"]
    assert results["stop_string"]["finish"][0] == "stop"
    finish = results["generate_until"]["finish"]
    assert None in finish and any(f is not None for f in finish)  # paused ones and finished ones
    assert any(len(ids) == 0 for ids in results["generate_until"]["ids"])  # never admitted before the stop


def test_a_shard_picks_the_vocabulary_parallel_sampler():
    model = random_model(GQA)
    assert token_sampler(model) is sample_from_logits  # the single-GPU path, untouched
    shard = TensorParallelCausalLM(GQA, rank=1, size=2)
    sampler = token_sampler(shard)
    assert sampler.keywords == dict(width=64, vocab_start=64, vocab_size=128, group=None)
    assert graph_capturable(model, (1.0, 0, 0.9, 0.0))
    assert not graph_capturable(shard, (1.0, 0, 0.9, 0.0))  # top-p without top-k
    assert not graph_capturable(shard, (1.0, 128, 0.9, 0.0))  # top-k of the whole vocabulary is off
    assert graph_capturable(shard, (1.0, 5, 0.9, 0.0)) and graph_capturable(shard, (0.0, 0, 0.9, 0.0))
    assert graph_capturable(shard, (1.0, 0, 1.0, 0.1))


def test_multi_turn_on_a_shard_is_refused():
    shard = TensorParallelCausalLM(GQA, rank=0, size=2)
    with pytest.raises(CohortError, match=r"multi-turn .* tensor-parallel shard: every rank would run the tools; "
                                          r"use (--rollout_tensor_parallel_size 1|rollout_tensor_parallel_size=1) for tool-using rollouts$"):
        Engine(shard).generate(PROMPTS, 1, params(), turns=object())
