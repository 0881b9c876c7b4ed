"""Tensor-parallel shards of the decoder (cohort_grpo/models/tensor_parallel.py): 2 ranks with gloo on the CPU,
in float32, give the logits of the unsharded model, for a full forward and for a prefill followed by
decode steps through the KV cache (the calls the engine makes), on the built-in tiny model (tied
embeddings, a vocabulary of 83 that 2 does not divide) and random Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral
models.

The two ranks are started once for the module (torch.multiprocessing spawn, a FileStore): each runs
every model's checks and saves what its shard returned; the tests compare those slices with the
unsharded model, run here in the test process."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cohort_grpo.errors import CohortError
from cohort_grpo.kernels.elementwise import fused_kernels
from cohort_grpo.models import CausalLM, KVCache, ModelConfig, from_pretrained
from cohort_grpo.models.tensor_parallel import (check_tensor_parallel_size, gather_logits, load_shard, shard_config,
                                           shard_model, shard_state_dict)

TOLERANCE = 1e-5
WORLD = 2
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
RANDOM_CONFIGS = {
    "llama": ModelConfig(model_type="llama", **SMALL),
    "llama_o_and_mlp_biases": ModelConfig(model_type="llama", attention_bias=True, mlp_bias=True, **SMALL),
    "qwen2_tied": ModelConfig(model_type="qwen2", tie_word_embeddings=True, **SMALL),
    "qwen3": ModelConfig(model_type="qwen3", **{**SMALL, "head_dim": 32}),
    "mistral_sliding": ModelConfig(model_type="mistral", sliding_window=3, **SMALL),
    # mixtures of experts: each expert split by its columns, the router whole; layer 1 of the Qwen3-MoE is dense
    "qwen3_moe_dense_layer": ModelConfig(model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], **SMALL),
    "mixtral": ModelConfig(model_type="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                           norm_topk_prob=True, **SMALL),
}
PROMPT_LENGTHS = [7, 4]  # row 1 right-padded in the prefill, as the engine pads
TOTAL_LENGTH = 12
DECODE_KV_LENGTH = 16


def random_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """A float32 model of `config`, every weight N(0, 0.05²) around its init (norm scales near 1, biases
    near 0 but not 0), so a bias or a norm added twice or not at all shows in the logits."""
    torch.manual_seed(seed)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def token_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, TOTAL_LENGTH), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def forward_checks(model: CausalLM, ids: torch.Tensor) -> dict:
    """What a model returns for `ids`: a full forward; a prefill of the prompts into cache rows [2, 0]
    (last-position logits through lm_head, as prefill.py computes them) with decode steps on those rows
    (plain path); a prefill into the default rows 0, 1 then decode steps as the engine's graph runs them
    (q/k/v and gate/up fused, inference mode, fused kernels on, uncompiled); each cache's keys and values."""
    out = {"full": model(ids)}
    lengths = torch.tensor(PROMPT_LENGTHS)
    width = max(PROMPT_LENGTHS)
    prompt_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    last = lengths - 1
    for name, rows in (("rows", torch.tensor([2, 0])), ("default_rows", None)):
        if rows is None:
            model.fuse_projections()  # as the engine does before it decodes
        cache = KVCache.for_model(model, num_rows=3, max_len=32)
        with fused_kernels(False):
            hidden = model(ids[:, :width], attention_mask=prompt_mask, kv_cache=cache, cache_rows=rows,
                           return_hidden=True, cache_len=width)
        out[f"{name}_prefill"] = model.lm_head(hidden[torch.arange(2), last])
        steps, decoded = lengths.clone(), []
        for _ in range(TOTAL_LENGTH - width):
            token = ids[torch.arange(2), steps][:, None]
            if rows is None:
                with torch.inference_mode(), fused_kernels(True, compile=False):
                    logits = model(token, steps[:, None], kv_cache=cache, cache_len=DECODE_KV_LENGTH)
                decoded.append(logits[:, 0].clone())
            else:
                decoded.append(model(token, steps[:, None], kv_cache=cache, cache_rows=rows,
                                     cache_len=DECODE_KV_LENGTH)[:, 0])
            steps = steps + 1
        out[f"{name}_decode"] = torch.stack(decoded, dim=1)
        out[f"{name}_keys"], out[f"{name}_values"] = cache.k.clone(), cache.v.clone()
    return out


def saved_model(folder: str, name: str) -> CausalLM:
    """The full model the parent saved as `name` (its config and weights) for the spawned ranks."""
    saved = torch.load(os.path.join(folder, f"{name}.pt"), weights_only=False)
    full = CausalLM(saved["config"]).eval()
    full.load_state_dict(saved["state"])
    return full


def run_rank(rank: int, folder: str, names: list[str]) -> None:
    """One of the two ranks: shard each saved model, save its checks' results (and its refusal)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)
    try:
        for name in names:
            full = saved_model(folder, name)
            shard = shard_model(full)
            ids = torch.load(os.path.join(folder, f"{name}.pt"), weights_only=False)["ids"]
            result = forward_checks(shard, ids)
            result["gathered"] = gather_logits(result["full"], vocab_size=full.config.vocab_size)
            result["shard_heads"] = (shard.config.num_attention_heads, shard.config.num_key_value_heads)
            result["vocab_range"] = (shard.vocab_start, shard.vocab_stop)
            torch.save(result, os.path.join(folder, f"{name}-rank{rank}.pt"))
        try:  # 4 heads and 4 KV heads: only the group's 2 ranks are too few for 4
            shard_model(random_model(dataclasses.replace(RANDOM_CONFIGS["llama"], num_key_value_heads=4)), size=4)
        except CohortError as error:
            torch.save(str(error), os.path.join(folder, f"refusal-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cases(tiny_dir, tmp_path_factory):
    """name -> (unsharded model, token ids, [rank 0's results, rank 1's])."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("tensor_parallel")
    models = {"tiny": from_pretrained(tiny_dir), **{n: random_model(c) for n, c in RANDOM_CONFIGS.items()}}
    for name, model in models.items():
        torch.save({"config": model.config, "state": model.state_dict(), "ids": token_ids(model.config.vocab_size)},
                   folder / f"{name}.pt")
    mp.spawn(run_rank, args=(str(folder), list(models)), nprocs=WORLD, join=True)
    return {name: (model, token_ids(model.config.vocab_size),
                   [torch.load(folder / f"{name}-rank{r}.pt") for r in range(WORLD)])
            for name, model in models.items()} | {
        "refusals": [torch.load(folder / f"refusal-rank{r}.pt") for r in range(WORLD)]}


def joined(slices: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The ranks' logit slices side by side, the padding past the vocabulary cut."""
    return torch.cat(slices, dim=-1)[..., :vocab_size]


MODELS = ["tiny", *RANDOM_CONFIGS]
OUTPUTS = ["full", "rows_prefill", "rows_decode", "default_rows_prefill", "default_rows_decode"]


@pytest.mark.cpu("float32 CPU numbers of two gloo ranks against one process")
@pytest.mark.parametrize("name", MODELS)
def test_two_ranks_give_the_unsharded_logits(cases, name):
    model, ids, ranks = cases[name]
    expected = forward_checks(model, ids)
    vocab = model.config.vocab_size
    for output in OUTPUTS:
        error = (joined([r[output] for r in ranks], vocab) - expected[output]).abs().max()
        assert error <= TOLERANCE, f"{output}: {error}"
    # the decode steps also continue the full forward (position p's logits), not only the unsharded cache's
    steps = torch.tensor(PROMPT_LENGTHS)[:, None] + torch.arange(TOTAL_LENGTH - max(PROMPT_LENGTHS))
    assert (expected["default_rows_decode"] - expected["full"][torch.arange(2)[:, None], steps]).abs().max() <= 1e-4
    for rank in ranks:
        assert (rank["gathered"] - expected["full"]).abs().max() <= TOLERANCE


@pytest.mark.cpu("float32 CPU numbers of two gloo ranks against one process")
@pytest.mark.parametrize("name", ["tiny", "qwen3"])
def test_each_rank_caches_its_own_kv_heads(cases, name):
    model, ids, ranks = cases[name]
    expected = forward_checks(model, ids)
    heads = model.config.num_key_value_heads // WORLD
    for r, rank in enumerate(ranks):
        assert rank["shard_heads"] == (model.config.num_attention_heads // WORLD, heads)
        for key in ("rows_keys", "rows_values", "default_rows_keys", "default_rows_values"):
            assert rank[key].shape[2] == heads
            error = (rank[key] - expected[key][:, :, r * heads:(r + 1) * heads]).abs().max()
            assert error <= TOLERANCE, f"rank {r} {key}: {error}"


def test_a_vocabulary_two_does_not_divide_is_padded_with_minus_infinity(cases):
    model, _, ranks = cases["tiny"]
    vocab = model.config.vocab_size
    assert vocab % WORLD  # 83: the padding is what this test is about
    rows = -(-vocab // WORLD)
    assert [r["vocab_range"] for r in ranks] == [(0, rows), (rows, vocab)]
    first, last = ranks[0]["full"], ranks[1]["full"]
    assert first.shape[-1] == last.shape[-1] == rows
    assert torch.isfinite(first).all() and torch.isfinite(last[..., :vocab - rows]).all()
    assert (last[..., vocab - rows:] == float("-inf")).all()


def test_a_tied_shard_keeps_embedding_and_head_one_tensor():
    config = RANDOM_CONFIGS["qwen2_tied"]
    shard = load_shard(config, random_model(config).state_dict(), size=1)
    assert shard.lm_head.weight is shard.model.embed_tokens.weight
    pieces = shard_state_dict(random_model(config).state_dict(), config, rank=1, size=2)
    assert torch.equal(pieces["lm_head.weight"], pieces["model.embed_tokens.weight"])
    assert pieces["model.embed_tokens.weight"].shape == (64, 64)


def test_slices_follow_heads_columns_and_rows():
    config = RANDOM_CONFIGS["qwen3"]
    state = random_model(config).state_dict()
    pieces = shard_state_dict(state, config, rank=1, size=2)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(pieces[q], state[q].view(4, 32, 64)[2:].reshape(64, 64))  # query heads 2, 3
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(pieces[k], state[k][32:])  # KV head 1
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(pieces[o], state[o][:, 64:])
    norm = "model.layers.0.self_attn.q_norm.weight"
    assert torch.equal(pieces[norm], state[norm])  # one head_dim weight shared by every head
    assert pieces["model.layers.0.mlp.down_proj.weight"].shape == (64, 48)
    assert shard_config(config, 2).num_key_value_heads == 1


def test_each_expert_is_split_by_its_columns_and_the_router_kept_whole():
    config = RANDOM_CONFIGS["qwen3_moe_dense_layer"]
    state = random_model(config).state_dict()
    pieces = shard_state_dict(state, config, rank=1, size=2)
    gate_up, down = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
    full = state[gate_up]  # [6, 64, 64]: gate rows 0..31, up rows 32..63
    assert torch.equal(pieces[gate_up], torch.cat([full[:, 16:32], full[:, 48:64]], dim=1))
    assert torch.equal(pieces[down], state[down][:, :, 16:32])
    assert torch.equal(pieces["model.layers.0.mlp.gate.weight"], state["model.layers.0.mlp.gate.weight"])
    assert pieces["model.layers.1.mlp.down_proj.weight"].shape == (64, 48)  # the dense layer: the MLP's split
    assert shard_config(config, 2).moe_intermediate_size == 16


def test_refusals_name_the_numbers(cases):
    config = ModelConfig(model_type="llama", **{**SMALL, "num_attention_heads": 6, "num_key_value_heads": 2,
                                                 "intermediate_size": 90})
    with pytest.raises(CohortError, match=r"rollout_tensor_parallel_size[= ]4 does not divide the model's 6 attention "
                                          r"heads; choose a .*rollout_tensor_parallel_size that divides 6"):
        check_tensor_parallel_size(config, 4)
    with pytest.raises(CohortError, match=r"[= ]3 does not divide the model's 2 KV heads; .* that divides 2$"):
        check_tensor_parallel_size(config, 3)
    with pytest.raises(CohortError, match=r"[= ]4 does not divide the model's 90 MLP columns \(intermediate_size\)"):
        check_tensor_parallel_size(dataclasses.replace(config, num_attention_heads=8, num_key_value_heads=4), 4)
    moe = RANDOM_CONFIGS["qwen3_moe_dense_layer"]
    with pytest.raises(CohortError, match=r"[= ]4 does not divide the model's 6 expert columns \(moe_intermediate_size\)"):
        check_tensor_parallel_size(dataclasses.replace(moe, num_key_value_heads=4, moe_intermediate_size=6), 4)
    with pytest.raises(CohortError, match=r"0 is not a positive whole number"):
        check_tensor_parallel_size(config, 0)
    llama = RANDOM_CONFIGS["llama"]
    with pytest.raises(CohortError, match=r"[= ]2 is more than the 1 rank\(s\) of its process group; choose at most 1"):
        load_shard(llama, random_model(llama).state_dict(), size=2)  # no torch.distributed here: one rank
    for message in cases["refusals"]:
        assert "4 is more than the 2 rank(s) of its process group; choose at most 2" in message
        assert "\n" not in message


def test_one_rank_is_the_model_itself():
    config = RANDOM_CONFIGS["llama_o_and_mlp_biases"]
    model = random_model(config)
    shard = shard_model(model)
    ids = token_ids(config.vocab_size)
    with torch.no_grad():
        assert torch.equal(shard(ids), model(ids))
    assert not any(p.requires_grad for p in shard.parameters())
    with pytest.raises(CohortError, match="cannot be saved"):
        shard.save_pretrained("unused")
