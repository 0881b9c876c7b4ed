"""The trainer's new weights into tensor-parallel shards in place (cohort_grpo/models/resharding.py): 2 ranks with
gloo on the CPU, in float32.

The two ranks are started once for the module (torch.multiprocessing spawn, a FileStore). Each shards
random models (GQA, a vocabulary of 83 that 2 does not divide, tied and untied embeddings, Qwen2's q/k/v
biases, Llama's o_proj / MLP biases, Qwen3's q/k norms), with and without fused q/k/v and gate/up, changes
the full model's weights and updates its shard from them; then it trains a model sharded by cohort's
FSDP2 path one step and updates a shard from the gathered parameters. It saves what it measured (logit
errors, moved addresses, full tensors left alive); the tests here read it.
"""

import dataclasses
import os
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.models.resharding import full_parameters, plain_parameter_name, update_shard_
from cohort_grpo.models.tensor_parallel import TensorParallelCausalLM, gather_logits, shard_model, shard_state_dict
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.parallel.engine_copy import EngineCopy
from test_tensor_parallel_model import random_model

TOLERANCE = 1e-5
WORLD = 2
SMALL = dict(vocab_size=83, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
CONFIGS = {
    "qwen2_tied": ModelConfig(model_type="qwen2", tie_word_embeddings=True, **SMALL),
    "llama_biases": ModelConfig(model_type="llama", attention_bias=True, mlp_bias=True, **SMALL),
    "qwen3": ModelConfig(model_type="qwen3", **{**SMALL, "head_dim": 32}),
}
UPDATES = [(name, fused) for name in CONFIGS for fused in (False, True)]


def token_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))


def addresses(shard) -> dict[str, int]:
    """Where the shard's tensors live: every parameter, and the fused q/k/v and gate/up matrices."""
    out = {name: p.data_ptr() for name, p in shard.named_parameters(remove_duplicate=False)}
    for i, layer in enumerate(shard.model.layers):
        for key, fused in (("qkv", layer.self_attn.fused_qkv), ("gate_up", layer.mlp.fused_gate_up)):
            if fused is not None:
                out[f"{i}.fused_{key}"] = fused[0].data_ptr()
    return out


def reads_fused(shard) -> bool:
    """Whether a no-grad forward takes the fused matrices (decoder.py's test: same address as q / gate)."""
    return all(layer.self_attn.fused_qkv is not None and layer.mlp.fused_gate_up is not None
               and layer.self_attn.fused_qkv[0].data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
               and layer.mlp.fused_gate_up[0].data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
               for layer in shard.model.layers)


def watched(items, alive: list[str]):
    """`items` passed on, noting in `alive` each name produced while the previous full tensor was still
    referenced somewhere (by the consumer or the producer): the one-at-a-time promise broken."""
    previous = None
    for name, tensor in items:
        if previous is not None and previous() is not None:
            alive.append(name)
        previous = weakref.ref(tensor)
        yield name, tensor
        del tensor


@torch.no_grad()
def logit_errors(shard, full, ids) -> float:
    return (gather_logits(shard(ids), vocab_size=full.config.vocab_size) - full(ids)).abs().max().item()


def update_check(config: ModelConfig, fused: bool) -> dict:
    """Shard a model, change the full model, update the shard from it: plain parameters one by one
    (unfused shard) or the state dict, both tied names included (fused shard)."""
    full = random_model(config)
    shard = shard_model(full)
    if fused:
        shard.fuse_projections()  # as the engine does before it decodes: the forward reads the fused matrices
    before, ids = addresses(shard), token_ids(config.vocab_size)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for parameter in full.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    stale = logit_errors(shard, full, ids)
    alive = []
    update_shard_(shard, full.state_dict().items() if fused else watched(full_parameters(full), alive))
    after = addresses(shard)
    return {"stale": stale, "error": logit_errors(shard, full, ids), "alive": alive,
            "moved": [name for name in before if after.get(name) != before[name]], "addresses": len(before),
            "reads_fused": reads_fused(shard), "tied": shard.lm_head.weight is shard.model.embed_tokens.weight}


def fsdp_check(rank: int) -> dict:
    """cohort's FSDP2 path (Parallel.wrap, fully_shard over gloo) trains one step; a fused TP=2 shard is
    updated from its gathered parameters and compared with the plain copy `EngineCopy.refresh` gathers."""
    config = CONFIGS["qwen2_tied"]
    plain = random_model(config)
    parallel = Parallel(rank, WORLD)
    sharded = parallel.wrap(plain, fsdp=True)
    shard = shard_model(plain)
    shard.fuse_projections()
    before, ids = addresses(shard), token_ids(config.vocab_size)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    logits = sharded((ids + rank) % config.vocab_size)  # each rank its own batch: the step uses both
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    optimizer.step()
    EngineCopy(plain, sharded).refresh()  # the plain copy as cohort's FSDP path gathers it
    stale = logit_errors(shard, plain, ids)
    names, alive = [], []
    for name, tensor in watched(full_parameters(sharded), alive):
        names.append(name)
        update_shard_(shard, [(name, tensor)], strict=False)
        del tensor
    update_shard_(shard, full_parameters(sharded))  # the same, as one stream (strict: every parameter came)
    after = addresses(shard)
    return {"stale": stale, "error": logit_errors(shard, plain, ids), "alive": alive, "names": names,
            "plain_names": [n for n, _ in plain.named_parameters()],
            "dtensors": all(hasattr(p, "full_tensor") for p in sharded.parameters()),
            "moved": [name for name in before if after.get(name) != before[name]], "reads_fused": reads_fused(shard)}


def run_rank(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        results = {(name, fused): update_check(CONFIGS[name], fused) for name, fused in UPDATES}
        results["fsdp"] = fsdp_check(rank)
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """[rank 0's results, rank 1's]."""
    folder = tmp_path_factory.mktemp("resharding")
    mp.spawn(run_rank, args=(str(folder),), nprocs=WORLD, join=True)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.cpu("float32 CPU numbers of two gloo ranks against one process")
@pytest.mark.parametrize("name, fused", UPDATES)
def test_an_updated_shard_gives_the_changed_models_logits_in_place(ranks, name, fused):
    for rank in ranks:
        result = rank[(name, fused)]
        assert result["stale"] > 1e-3  # the change shows before the update
        assert result["error"] <= TOLERANCE
        assert result["moved"] == [] and result["addresses"] > 0  # in place: every tensor where it was
        assert result["reads_fused"] == fused  # the fused forward read the fused matrices, and they changed
        assert result["alive"] == []  # one full tensor at a time
        assert result["tied"] == CONFIGS[name].tie_word_embeddings


@pytest.mark.cpu("float32 CPU numbers of two gloo ranks against FSDP2's gathered copy")
def test_a_shard_updated_from_fsdp2_gives_the_trained_models_logits(ranks):
    for rank in ranks:
        result = rank["fsdp"]
        assert result["dtensors"]  # fully_shard on gloo: every parameter a DTensor
        assert result["names"] == result["plain_names"]  # FSDP2 keeps the plain names (a tied weight once)
        assert result["stale"] > 1e-3
        assert result["error"] <= TOLERANCE
        assert result["moved"] == [] and result["reads_fused"]
        assert result["alive"] == []  # each gathered parameter freed before the next gather


def local_shard(config: ModelConfig, rank: int) -> TensorParallelCausalLM:
    """Rank `rank` of 2, built in this process (updating it needs no communication)."""
    return TensorParallelCausalLM(config, rank, 2).requires_grad_(False)


@pytest.mark.parametrize("rank", [0, 1])
def test_an_update_writes_what_shard_state_dict_cuts(rank):
    config = CONFIGS["llama_biases"]
    state = random_model(config).state_dict()
    shard = update_shard_(local_shard(config, rank), state.items())
    pieces, real = shard_state_dict(state, config, rank, 2), shard.vocab_stop - shard.vocab_start
    for name, tensor in shard.state_dict().items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # padded rows: never read
            tensor, pieces[name] = tensor[:real], pieces[name][:real]
        assert torch.equal(tensor, pieces[name]), name
    one = update_shard_(CausalLM(config), full_parameters(random_model(config)))  # T = 1: a plain model, whole
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), state.values()))


def test_a_weight_that_does_not_fit_is_one_line_naming_it():
    config = CONFIGS["qwen2_tied"]
    state = random_model(config).state_dict()
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    cases = [
        ([("model.layers.7.mlp.up_proj.weight", state[q])], "model.layers.7.mlp.up_proj.weight has no place"),
        ([("_orig_mod.lm_head.weight", state["lm_head.weight"])], "_orig_mod.lm_head.weight has no place"),
        ([(k, state[q])], rf"{k} has shape \(64, 64\), whose rank-1 slice \(32, 64\) does not fit the shard's \(16, 64\)"),
        ([(q, state[q][:, :-1])], rf"{q} has shape \(64, 63\), whose rank-1 slice"),
        ([(q, state[q][:-1])], rf"{q} has shape \(63, 64\), which 2 ranks cannot split along dimension 0"),
        ([("lm_head.weight", F.pad(state["lm_head.weight"], (0, 0, 0, 1)))],
         r"lm_head.weight has shape \(84, 64\), but the model has 83 vocabulary rows"),
        ([(q, state[q])], r"weight\(s\) of the shard were not updated \(model.embed_tokens.weight, "),
    ]
    for items, message in cases:
        with pytest.raises(CohortError, match=message) as error:
            update_shard_(local_shard(config, 1), items)
        assert "\n" not in str(error.value)
    config = dataclasses.replace(config, tie_word_embeddings=False)
    with pytest.raises(CohortError, match=r"\(lm_head.weight\)"):  # untied: the embedding does not update the head
        update_shard_(local_shard(config, 0), [(n, t) for n, t in state.items() if n != "lm_head.weight"])


def test_wrapper_prefixes_leave_the_plain_names():
    name = "model.layers.0.mlp.up_proj.weight"
    for wrapped in (name, f"_orig_mod.{name}", f"module.{name}", f"module._orig_mod.{name}",
                    "model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight",
                    "_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight"):
        assert plain_parameter_name(wrapped) == name
    assert plain_parameter_name("module") == "module"
