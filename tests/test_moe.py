"""cohort's Qwen3-MoE against transformers' on tiny random configs; loading, saving, refusals, the cache."""

import json

import pytest
import torch
from reference_models import assert_logits_match, padded_batch, save_perturbed_references
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from cohort_grpo.errors import CohortError
from cohort_grpo.models import KVCache, from_pretrained
from cohort_grpo.models.moe import Routing, fuse_expert_weights, split_expert_weights

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


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    assert_logits_match(ours, reference, TINY_MOE["vocab_size"])


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folder_loads_in_transformers_with_per_expert_names(checkpoints, family, tmp_path):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    ours.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "config.json").read_text())
    assert index["architectures"] == ["Qwen3MoeForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, _, _ = padded_batch(TINY_MOE["vocab_size"])
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
    ids, _, _ = padded_batch(TINY_MOE["vocab_size"])
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
    ids, _, _ = padded_batch(TINY_MOE["vocab_size"])
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


def _our_moe(**config):
    from cohort_grpo.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    return CausalLM(ModelConfig(**{**dict(model_type="qwen3_moe", vocab_size=40, hidden_size=16, intermediate_size=24,
                                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                          mlp_only_layers=[2]), **config}))


def test_config_counts_and_flops_of_a_moe():
    from cohort_grpo.plans.sampling_plan import parameter_count
    from cohort_grpo.telemetry.metrics import update_flops

    model = _our_moe()
    qk_norms = sum(p.numel() for name, p in model.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight")))
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters()) - qk_norms  # it leaves those out
    experts = sum(p.numel() for layer in model.model.layers[:2] for p in layer.mlp.experts.parameters())
    head, embed = model.lm_head.weight.numel(), model.model.embed_tokens.weight.numel()
    others = sum(p.numel() for p in model.parameters()) - experts - head - embed
    # every weight 6 FLOPs per token; an expert's only on its k/E share of the tokens; the head on completions
    assert update_flops(model, 3, 5) == pytest.approx(6 * 8 * (others + experts * 2 / 4) + 6 * 5 * head)


def test_load_balancing_loss_matches_switch_formula():
    from cohort_grpo.models.moe import load_balancing_loss

    probs = torch.softmax(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), -1)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0], [1, 2], [0, 3]])
    share = [sum(int(e == i) for row in ids.tolist() for i in row) / 12 for e in range(4)]
    expected = 4 * sum(share[e] * float(probs[:, e].mean()) for e in range(4))
    assert float(load_balancing_loss(probs, ids, 4)) == pytest.approx(expected, rel=1e-6)


def test_moe_refusals_name_the_option():
    from cohort_grpo import GRPOConfig
    from cohort_grpo.rollout.partial import partial_rollout_settings

    with pytest.raises(CohortError, match=r"router_aux_loss_coef[= ]-1"):
        GRPOConfig(router_aux_loss_coef=-1).validate()
    args = GRPOConfig(partial_rollouts=True, max_staleness=2, async_rollouts=True, rollout_gpus=1)
    with pytest.raises(CohortError, match="routing_replay"):
        partial_rollout_settings(args, engine=True, tools=False, routing_replay=True)
    assert partial_rollout_settings(GRPOConfig(rollout_gpus=1, async_rollouts=True), engine=True, tools=False,
                                    routing_replay=True)["partial_rollouts"] is False


# Each family's folder as transformers writes it, for the model's own tokenizer (its vocabulary, pad and EOS).
SAVED_FAMILIES = {
    "qwen3_moe": lambda vocab, special: Qwen3MoeConfig(**{**TINY_MOE, "vocab_size": vocab}, **special,
                                                       norm_topk_prob=True),
    "mixtral": lambda vocab, special: MixtralConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab, max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2, **special,
        bos_token_id=None),
}


@pytest.mark.parametrize("family", SAVED_FAMILIES)
def test_cohort_train_runs_a_transformers_saved_moe_folder(tmp_path, family):
    """`cohort-grpo train --model <a folder transformers wrote>` on the CPU: our model, the engine's routes
    replayed, the routing metrics logged, the final policy a folder transformers loads as the same family."""
    from cohort_grpo.cli import main
    from cohort_grpo.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(SAVED_FAMILIES[family](len(tokenizer), special)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "model"), "--max_steps", "2", "--output_dir", str(out),
                 "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "6",
                 "--eval_limit", "4", "--device", "cpu", "--quiet", "true"]) == 0
    last = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r][-1]
    assert last["routing/replay_mismatch"] >= 0 and last["routing/expert_load_max_over_mean"] >= 1
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == family


@pytest.mark.slow
def test_compiled_training_layers_equal_eager_with_replay_in_one_graph_for_all_moe_layers():
    """torch.compile of the training layer (float32 on the CPU) runs the MoE layers too: the same logits, router
    reports and gradients as eager with routes replayed, and one graph serves both MoE layers (one the dense)."""
    from torch._dynamo.utils import counters

    model = _our_moe(num_hidden_layers=3, mlp_only_layers=[1]).train()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    recorded = torch.randint(0, 4, (2, 9, 2, 2), generator=torch.Generator().manual_seed(2), dtype=torch.int16)

    def step():
        record = Routing(recorded, replay=True, keep_router=True)
        logits = model(ids, routing=record)
        (logits.square().mean() + sum(p.sum() for p in record.router_probs)).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        return logits.detach(), record, grads

    eager = step()
    torch._dynamo.reset()
    counters.clear()
    model.compile_for_training()
    compiled = step()
    assert not model.training_layer_call.failed and counters["stats"]["unique_graphs"] == 2
    assert (compiled[0] - eager[0]).abs().max() <= 1e-5
    assert torch.equal(compiled[1].free_differs, eager[1].free_differs) and compiled[1].free_differs.any()
    assert len(compiled[1].expert_ids) == 2 and all(
        torch.equal(a, b) for a, b in zip(compiled[1].expert_ids, eager[1].expert_ids))
    for name, grad in eager[2].items():
        assert (compiled[2][name] - grad).abs().max() <= 1e-5 * max(1.0, grad.abs().max()), name
    assert eager[2]["model.layers.0.mlp.experts.down_proj"].abs().max() > 0


def test_qwen3_30b_a3b_counts_its_experts():
    """The plans count every expert: Qwen3-30B-A3B's config gives the 30.5B weights transformers builds (less the
    q/k norms, which the count leaves out), and the layer FSDP2 gathers is a whole MoE layer."""
    from cohort_grpo.plans.sampling_plan import parameter_count
    from cohort_grpo.plans.training_plan import layer_parameter_count
    from cohort_grpo.models import ModelConfig

    fields = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, tie_word_embeddings=False)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**fields))
    norms = sum(p.numel() for name, p in theirs.named_parameters() if name.endswith(("q_norm.weight", "k_norm.weight")))
    config = ModelConfig(model_type="qwen3_moe", **fields)
    assert parameter_count(config) == sum(p.numel() for p in theirs.parameters()) - norms
    assert 30.4e9 < parameter_count(config) < 30.6e9
    layer = theirs.model.layers[0]
    assert layer_parameter_count(config) == sum(p.numel() for name, p in layer.named_parameters()
                                                if not name.endswith(("q_norm.weight", "k_norm.weight")))


def test_routing_reports_reach_the_caller_through_fsdp2_mixed_precision(tmp_path):
    """FSDP2 with a mixed-precision policy (the GPU's) rebuilds dataclass inputs to cast their tensors: the
    layers' reports (the replay mismatch, the router's outputs) must still land in the caller's `Routing`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _our_moe()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=True)
        mesh = init_device_mesh("cpu", (1,))  # else FSDP2 moves the model to a GPU where one is visible
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
        recorded = torch.zeros(2, 7, 2, 2, dtype=torch.int16)
        recorded[..., 1] = 1  # experts 0 and 1 everywhere: the free router picks others somewhere
        record = Routing(recorded, replay=True, keep_router=True)
        model(ids, routing=record)
    finally:
        dist.destroy_process_group()
    assert record.free_differs is not None and record.free_differs.shape == (2, 7) and record.free_differs.any()
    assert len(record.router_probs) == len(record.expert_ids) == 2  # the two MoE layers (layer 2 is dense)
    assert torch.equal(record.expert_ids[0].sort(-1).values, recorded[:, :, 0].reshape(-1, 2).long())  # replayed
