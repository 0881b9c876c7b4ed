"""cohort's Mixtral against transformers' `MixtralForCausalLM` on tiny random configs: logits, the sliding window,
the checkpoint names saved back, the KV cache's decode and routes, refusals, and `cohort-grpo train` on a folder."""

import json

import pytest
import torch
from reference_models import assert_logits_match, padded_batch, save_perturbed_references
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MixtralConfig

from cohort_grpo.errors import CohortError
from cohort_grpo.models import KVCache, ModelConfig, from_pretrained
from cohort_grpo.models.moe import Routing, fuse_expert_weights, split_expert_weights

torch.set_num_threads(1)
TINY = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "mixtral_top2": lambda: MixtralConfig(**TINY),
    "mixtral_sliding_top3_tied": lambda: MixtralConfig(**{**TINY, "num_local_experts": 5, "num_experts_per_tok": 3},
                                                       sliding_window=4, tie_word_embeddings=True),
    "mixtral_head_dim_16_theta": lambda: MixtralConfig(**TINY, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_perturbed_references(FAMILIES, tmp_path_factory)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    assert ours.config.sparse_layers == [0, 1] and ours.config.moe_intermediate_size == TINY["intermediate_size"]
    assert_logits_match(ours, reference, TINY["vocab_size"])


def test_the_window_matters(checkpoints):
    """The sliding-window family's logits are not those of the same weights with full attention, so the
    parity above checks the window."""
    _, folder = checkpoints["mixtral_sliding_top3_tied"]
    windowed = from_pretrained(folder)
    full = from_pretrained(folder)
    full.config.sliding_window = None
    ids, _, _ = padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert (windowed(ids) - full(ids))[:, 4:].abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folder_has_mixtrals_names_and_loads_in_transformers(checkpoints, family, tmp_path):
    reference, folder = checkpoints[family]
    from_pretrained(folder).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved, \
            safe_open(str(folder / "model.safetensors"), "pt") as theirs:
        assert set(saved.keys()) == set(theirs.keys())  # block_sparse_moe.experts.{e}.w1/w2/w3, as transformers writes
        assert "model.layers.1.block_sparse_moe.experts.0.w3.weight" in saved.keys()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    ids, _, _ = padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert (reloaded(ids).logits - reference(ids).logits).abs().max() <= 1e-6


def test_expert_names_round_trip_as_a_resumed_checkpoint_reads_them(checkpoints):
    """A run's checkpoint holds the policy under Mixtral's names; reading it back (by name alone, without the
    config) gives our tensors exactly."""
    state = from_pretrained(checkpoints["mixtral_top2"][1]).state_dict()
    split = split_expert_weights(state, "mixtral")
    assert not any(".mlp." in name for name in split)
    assert torch.equal(split["model.layers.0.block_sparse_moe.experts.3.w3.weight"],
                       state["model.layers.0.mlp.experts.gate_up_proj"][3, TINY["intermediate_size"]:])
    fused = fuse_expert_weights(split)
    assert fused.keys() == state.keys() and all(torch.equal(fused[k], state[k]) for k in state)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips(checkpoints, family):
    hf = json.loads((checkpoints[family][1] / "config.json").read_text())
    config = ModelConfig.from_hf_dict(hf)
    again = config.to_hf_dict()
    assert ModelConfig.from_hf_dict(again) == config
    assert again["num_local_experts"] == hf["num_local_experts"] and "moe_intermediate_size" not in again
    assert again["router_aux_loss_coef"] == hf["router_aux_loss_coef"]  # kept for the folder, never applied


def test_rope_base_defaults_to_mixtrals(checkpoints, tmp_path):
    """A config.json without a RoPE base gets transformers' Mixtral default (1e6), not the 10000 of the others."""
    _, folder = checkpoints["mixtral_top2"]
    hf = json.loads((folder / "config.json").read_text())
    hf.pop("rope_parameters", None)
    hf.pop("rope_theta", None)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = from_pretrained(tmp_path)
    assert ours.config.rope_theta == 1e6
    ids, _, _ = padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("key,value", [("router_jitter_noise", 0.1), ("hidden_act", "gelu"),
                                       ("shared_expert_intermediate_size", 64)])
def test_what_cohorts_mixtral_lacks_is_refused_by_name(checkpoints, tmp_path, key, value):
    _, folder = checkpoints["mixtral_top2"]
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(CohortError, match=rf"{key}.*Mixtral does not implement.*model_impl[= ]'?hf"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["mixtral_top2", "mixtral_sliding_top3_tied"])
def test_cached_prefill_and_decode_match_full_forward_and_record_routes(checkpoints, family):
    ours = from_pretrained(checkpoints[family][1])
    top_k = ours.config.num_experts_per_tok
    ids, _, _ = padded_batch(TINY["vocab_size"])
    cache = KVCache.for_model(ours, num_rows=2, max_len=16)
    assert cache.routes.shape == (2, 16, 2, top_k)  # every layer a mixture of experts
    with torch.no_grad():
        full = ours(ids)
        prefill = ours(ids[:, :6], kv_cache=cache)
        steps = [ours(ids[:, t: t + 1], torch.full((2, 1), t), kv_cache=cache) for t in range(6, 10)]
    assert (torch.cat([prefill, *steps], 1) - full).abs().max() <= 1e-5
    record = Routing(keep_router=True)
    with torch.no_grad():
        ours(ids, routing=record)
    for moe_layer, ids_of_layer in enumerate(record.expert_ids):
        recorded = cache.routes[:, :10, moe_layer].long().reshape(-1, top_k)
        assert torch.equal(recorded.sort(-1).values, ids_of_layer.sort(-1).values)
