"""cohort's Qwen3-MoE against transformers' on tiny random configs; loading, saving, refusals, the cache."""

import json

import pytest
import torch
from reference_models import save_perturbed_references
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from cohort.errors import CohortError
from cohort.models import KVCache, from_pretrained
from cohort.models.moe import Routing, fuse_expert_weights, split_expert_weights

torch.set_num_threads(1)
TINY_MOE = dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=96, max_position_embeddings=128,
                num_experts=6, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe_norm_topk": lambda: Qwen3MoeConfig(**TINY_MOE, norm_topk_prob=True),
    "qwen3_moe_dense_layer_tied": lambda: Qwen3MoeConfig(**TINY_MOE, mlp_only_layers=[1], tie_word_embeddings=True),
    "qwen3_moe_sparse_step_2_top3": lambda: Qwen3MoeConfig(**{**TINY_MOE, "num_experts_per_tok": 3},
                                                           decoder_sparse_step=2, norm_topk_prob=True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_perturbed_references(FAMILIES, tmp_path_factory)


def _batch():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY_MOE["vocab_size"], (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    ids, mask, positions = _batch()
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max() <= 1e-5
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
        assert (ours(ids, positions, mask) - expected)[mask.bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folder_loads_in_transformers_with_per_expert_names(checkpoints, family, tmp_path):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    ours.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "config.json").read_text())
    assert index["architectures"] == ["Qwen3MoeForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, _, _ = _batch()
    with torch.no_grad():
        assert (reloaded(ids).logits - reference(ids).logits).abs().max() <= 1e-6


def test_stacked_expert_names_load_too(checkpoints, tmp_path):
    """A checkpoint holding transformers 5's in-memory layout (`experts.gate_up_proj`) loads as one with a
    matrix per expert does."""
    reference, folder = checkpoints["qwen3_moe_norm_topk"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    state = {k: v.contiguous() for k, v in from_pretrained(folder).state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    ids, _, _ = _batch()
    with torch.no_grad():
        assert (from_pretrained(tmp_path)(ids) - reference(ids).logits).abs().max() <= 1e-5


def test_expert_names_round_trip():
    state = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 4),
             "model.layers.0.mlp.experts.down_proj": torch.randn(3, 4, 4), "lm_head.weight": torch.randn(2, 4)}
    split = split_expert_weights(state)
    assert "model.layers.0.mlp.experts.2.up_proj.weight" in split and len(split) == 10
    assert torch.equal(split["model.layers.0.mlp.experts.1.gate_proj.weight"], state[
        "model.layers.0.mlp.experts.gate_up_proj"][1, :4])
    fused = fuse_expert_weights(split)
    assert fused.keys() == state.keys() and all(torch.equal(fused[k], state[k]) for k in state)


@pytest.mark.parametrize("key,value", [("shared_expert_intermediate_size", 64), ("n_group", 2)])
def test_other_families_moe_settings_are_refused_by_name(checkpoints, tmp_path, key, value):
    _, folder = checkpoints["qwen3_moe_norm_topk"]
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(CohortError, match=key):
        from_pretrained(tmp_path)


def test_cached_prefill_and_decode_match_full_forward_and_record_routes(checkpoints):
    ours = from_pretrained(checkpoints["qwen3_moe_dense_layer_tied"][1])
    ids, _, _ = _batch()
    cache = KVCache.for_model(ours, num_rows=2, max_len=16)
    assert cache.routes.shape == (2, 16, 2, 2)  # layer 1 is dense: two MoE layers, top-2
    with torch.no_grad():
        full = ours(ids)
        prefill = ours(ids[:, :6], kv_cache=cache)
        steps = [ours(ids[:, t: t + 1], torch.full((2, 1), t), kv_cache=cache) for t in range(6, 10)]
    assert (torch.cat([prefill, *steps], 1) - full).abs().max() <= 1e-5
    record = Routing(keep_router=True)
    with torch.no_grad():
        ours(ids, routing=record)
    for moe_layer, ids_of_layer in enumerate(record.expert_ids):
        recorded = cache.routes[:, :10, moe_layer].long().reshape(-1, 2)
        assert torch.equal(recorded.sort(-1).values, ids_of_layer.sort(-1).values)
