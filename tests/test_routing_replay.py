"""Routing replay: the trainer's forwards route by the experts the engine chose, so its log-probs equal the
engine's even where its own router would choose otherwise; the choices flow through packing, micro-batches,
shared prompts, the update and a checkpoint's resume."""

import json

import pytest
import torch
import torch.nn.functional as F

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.models.moe import LayerRouting, Routing
from cohort_grpo.models.tiny import build_tokenizer
from cohort_grpo.rollout.engine import Engine
from cohort_grpo.rollout.layout import PADDED, Layout
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.tasks.arithmetic import ArithmeticTask
from cohort_grpo.update.logprobs import forward_hidden, micro_batch_logprobs, rollout_logprobs
from cohort_grpo.update.packing import pack
from cohort_grpo.update.routing import replay_mismatch

torch.set_num_threads(1)


def near_tie_moe(vocab_size: int = 64, seed: int = 0, **config) -> CausalLM:
    """A random Qwen3-MoE whose experts come in pairs with router rows 1e-7 apart: a token's top-3 then
    takes one expert of some pair, decided by the last bits of the router logits, which differ between the
    engine's cached forwards and the trainer's full one. The pair's experts differ, so a flip shows."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**{**dict(
        model_type="qwen3_moe", vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=16, norm_topk_prob=True), **config})).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            router = layer.mlp.gate.weight
            router.normal_()
            router[1::2] = router[0::2] + 1e-7 * torch.randn_like(router[0::2])
            layer.mlp.experts.gate_up_proj.normal_(std=0.5)
            layer.mlp.experts.down_proj.normal_(std=0.5)
    return model


@pytest.fixture(scope="module")
def sampled():
    model = near_tie_moe()
    prompts = [[int(t) for t in torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 9, 3, 7)]
    rollout = Engine(model, max_batch_size=8, check_interval=4).generate(
        prompts, 2, SamplingParams(max_new_tokens=12, seed=1, pad_token_id=0))
    return model, [p for p in prompts for _ in range(2)], rollout


@pytest.mark.parametrize("shared", [False, True])
def test_replayed_logprobs_equal_the_engines_where_free_routing_differs(sampled, shared):
    model, prompts, rollout = sampled
    assert rollout.routed_experts.dtype == torch.int16 and rollout.routed_experts.shape[2:] == (2, 3)
    mask = rollout.completion_mask.bool()
    errors, mismatches = {}, {}
    for replay in (True, False):
        logp = rollout_logprobs(model, prompts, rollout.completion_ids, rollout.completion_mask, pad_id=0, max_rows=3,
                                layout=Layout(shared=shared), routes=rollout.routed_experts, replay=replay)
        errors[replay] = (logp - rollout.logprobs)[mask].abs().max()
        micro = pack(prompts, rollout.completion_ids, rollout.completion_mask, list(range(8)), 0,
                     Layout(shared=shared), routes=rollout.routed_experts, replay=replay)
        with torch.no_grad():
            forward_hidden(model, micro)
        mismatches[replay] = float(replay_mismatch(micro))
    assert errors[True] <= 1e-5
    assert mismatches[True] > 0.1  # the trainer's own top-k differs from the engine's for many tokens ...
    assert errors[False] > 1e-3  # ... and routing freely, its log-probs are not the sampler's


def test_mismatch_counts_the_positions_whose_free_top_k_differs(sampled):
    """An independent count: the trainer's free top-k per MoE layer (from its routers' outputs) against the
    recorded ids, at each completion token's predicting position."""
    model, prompts, rollout = sampled
    micro = pack(prompts, rollout.completion_ids, rollout.completion_mask, list(range(8)), 0, PADDED,
                 routes=rollout.routed_experts, replay=False, keep_router=True)
    with torch.no_grad():
        forward_hidden(model, micro)
    recorded = micro.routing.recorded
    differs = torch.zeros(recorded.shape[:2], dtype=torch.bool)
    for layer, ids in enumerate(micro.routing.expert_ids):  # free routing: the ids routed by are the router's
        free = ids.reshape(*recorded.shape[:2], -1).sort(-1).values
        differs |= (free != recorded[:, :, layer].long().sort(-1).values).any(-1)
    expected = differs[micro.source_rows, micro.source_cols].float().mean()
    assert float(replay_mismatch(micro)) == pytest.approx(float(expected))


def test_replay_keeps_the_routers_gradient(sampled):
    model, prompts, rollout = sampled
    micro = pack(prompts, rollout.completion_ids, rollout.completion_mask, [0, 3, 5], 0, Layout(shared=True),
                 routes=rollout.routed_experts)
    model.zero_grad()
    out = micro_batch_logprobs(model, micro)
    out.logp.sum().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    expected = rollout.logprobs[[0, 3, 5]][:, : out.logp.shape[1]] * micro.completion_mask
    assert (out.logp.detach() - expected).abs().max() <= 1e-5


def far_from_ties_moe(norm_topk_prob: bool = True) -> CausalLM:
    """A random Qwen3-MoE (float32) whose routers' logits are far apart (rows of std 1 over a hidden size of 16):
    a token's top-3 is decided by whole units of logit, not by the last bits."""
    torch.manual_seed(4)
    model = CausalLM(ModelConfig(
        model_type="qwen3_moe", vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=8, mlp_only_layers=[1], norm_topk_prob=norm_topk_prob))
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.sparse:
                layer.mlp.gate.weight.normal_()
                layer.mlp.experts.gate_up_proj.normal_(std=0.5)
                layer.mlp.experts.down_proj.normal_(std=0.5)
    return model


def recorded_elsewhere(shape: tuple[int, ...], experts: int, k: int, seed: int) -> torch.Tensor:
    """[*shape, k] int16: for each position k distinct experts drawn at random, as another router (a sampler's
    weights one update behind, say) may have chosen them: mostly not this router's top-k."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(*shape, experts, generator=generator)
    return draws.argsort(-1)[..., :k].to(torch.int16)


def replayed_block_reference(block, x: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """What a mixture-of-experts block replaying `recorded` [B, T, k] computes, written apart from SparseMoeBlock:
    in float64, each token's softmax over all its router logits, read at its recorded experts (renormalised over
    them with norm_topk_prob), weights those experts' SwiGLU outputs (gate the first half of gate_up_proj)."""
    flat = x.reshape(-1, x.shape[-1]).double()
    ids = recorded.reshape(flat.shape[0], -1).long()
    probs = torch.softmax(flat @ block.gate.weight.double().T, dim=-1)
    weights = probs.gather(1, ids)
    if block.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    gate_up, down = block.experts.gate_up_proj.double()[ids], block.experts.down_proj.double()[ids]
    gate, up = torch.einsum("nkoh,nh->nko", gate_up, flat).chunk(2, dim=-1)
    outputs = torch.einsum("nkhi,nki->nkh", down, F.silu(gate) * up)
    return (weights[..., None] * outputs).sum(1).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_a_replayed_block_weights_the_recorded_experts_by_its_softmax_there(norm_topk_prob):
    """Routes far from ties, recorded by another router: the block's output and every gradient (the router's
    included) are the reference's, which weights the recorded experts by this router's softmax at them."""
    block = far_from_ties_moe(norm_topk_prob).model.layers[0].mlp
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    recorded = recorded_elsewhere((2, 9), 8, 3, seed=6)
    cotangent = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(7))
    grads = {}
    for name, forward in (("block", lambda: block(x, LayerRouting(recorded))),
                          ("reference", lambda: replayed_block_reference(block, x, recorded))):
        block.zero_grad()
        x.grad = None
        out = forward()
        (out * cotangent).sum().backward()
        grads[name] = (out.detach(), x.grad.clone(), *(p.grad.clone() for p in block.parameters()))
    for got, expected in zip(grads["block"], grads["reference"]):
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert grads["reference"][2].abs().max() > 1e-2  # the router's gradient: block.parameters() starts with it
    # The test has teeth: the recorded experts are mostly not the router's top-k, and their softmax weights
    # differ from the top-k's by far more than the tolerance.
    routing = LayerRouting(recorded)
    with torch.no_grad():
        block(x, routing)
        probs = torch.softmax(block.gate(x.reshape(-1, 16)), -1)
    assert routing.free_differs.float().mean() > 0.8
    free_top = probs.topk(3, -1).values
    assert (free_top - probs.gather(1, recorded.reshape(-1, 3).long())).abs().max() > 0.1


def test_a_replayed_model_is_the_one_whose_moe_blocks_are_the_reference(monkeypatch):
    """Through the whole model (each MoE layer its own slice of the routes): logits and the routers' gradients
    equal those of the same model whose MoE blocks are replaced by `replayed_block_reference`."""
    model = far_from_ties_moe()
    ids = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(8))
    recorded = recorded_elsewhere((2, 7, 2), 8, 3, seed=9)
    routers = [layer.mlp.gate.weight for layer in model.model.layers if layer.sparse]
    results = {}
    for name in ("model", "reference"):
        if name == "reference":
            for layer in model.model.layers:
                if layer.sparse:
                    monkeypatch.setattr(layer.mlp, "forward", lambda x, routing, block=layer.mlp, **_:
                                        replayed_block_reference(block, x, routing.recorded))
        model.zero_grad()
        routing = Routing(recorded)
        logits = model(ids, routing=routing)
        logits.logsumexp(-1).sum().backward()
        results[name] = (logits.detach(), *(router.grad.clone() for router in routers))
    for got, expected in zip(results["model"], results["reference"]):
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert all(grad.abs().max() > 1e-3 for grad in results["reference"][1:])


def _moe_folder(path):
    tokenizer = build_tokenizer()
    model = near_tie_moe(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _digit_share(prompts, completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class Crash(Exception):
    pass


def _crashing_in_step(step: int):
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise Crash
        return _digit_share(prompts, completions)
    reward.__name__ = _digit_share.__name__  # the same metric names as the run it is compared with
    return reward


def _run(folder, out, reward=_digit_share, **overrides):
    task = ArithmeticTask()
    args = GRPOConfig(**{**dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=6,
                                max_steps=4, save_steps=2, learning_rate=3e-3, num_iterations=2, beta=0.05,
                                output_dir=str(out), quiet=True, seed=0, device="cpu", eval_limit=4),
                         **overrides})
    trainer = GRPOTrainer(folder, reward, task.load("train", size=32, seed=0), args=args, task=task)
    trainer.train()
    return trainer


def _records(path):
    wall = ("time", "step_time")
    return [{k: v for k, v in json.loads(line).items() if k not in wall and not k.startswith(
        ("time/", "tokens_per_second", "peak_memory"))} for line in path.read_text().splitlines()]


@pytest.mark.parametrize("async_rollouts", [False, True])
def test_replay_survives_checkpoint_and_resume_exactly(tmp_path, async_rollouts):
    """A run that crashes in step 3 and resumes from checkpoint-2 (holding, with asynchronous rollouts, the
    rollout sampled ahead and its routes) ends as the run that never stopped."""
    folder = _moe_folder(tmp_path / "model")
    straight = _run(folder, tmp_path / "straight", async_rollouts=async_rollouts)
    with pytest.raises(CohortError, match="Crash"):
        _run(folder, tmp_path / "resumed", reward=_crashing_in_step(3), async_rollouts=async_rollouts)
    resumed = _run(folder, tmp_path / "resumed", resume=True, async_rollouts=async_rollouts)
    records = _records(tmp_path / "straight/metrics.jsonl")
    assert any(r.get("routing/replay_mismatch", 0) > 0 for r in records)  # replay did change the routing
    assert _records(tmp_path / "resumed/metrics.jsonl") == records
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_router_loss_enters_the_update_as_the_steps_mean_over_completions(tmp_path):
    """The update's gradient with router_aux_loss_coef = c, less its gradient with 0, is c times the gradient of
    the step's load-balancing loss computed here on its own: each micro-batch's Switch loss standing for its
    rows, averaged over the step's completions."""
    import dataclasses

    from helpers import synthetic_batch

    from cohort_grpo.update.routing import router_aux_loss

    coef = 0.5
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=6, gradient_accumulation_steps=2,
                      max_completion_length=6, max_steps=1, output_dir=str(tmp_path / "run"), quiet=True, seed=0,
                      device="cpu", beta=0.04, max_grad_norm=1e9, router_aux_loss_coef=coef)
    task = ArithmeticTask()
    trainer = GRPOTrainer(_moe_folder(tmp_path / "model"), _digit_share, task.load("train", size=16, seed=0),
                          args=args, task=task)
    model, update = trainer.train_model, trainer.policy_update
    batch = synthetic_batch(trainer)

    def gradient() -> dict[str, torch.Tensor]:
        seen = {}
        trainer.optimizer.step = lambda *a, **k: seen.update(
            {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        trainer.update(batch)
        return seen

    with_aux = gradient()
    update.args = dataclasses.replace(update.args, router_aux_loss_coef=0.0)
    without = gradient()

    plans = update.plan(batch)
    assert len(plans) > 1 and len({len(rows) for rows in plans}) > 1  # micro-batches of unequal size
    model.train()
    model.zero_grad(set_to_none=True)
    step_loss = 0.0
    for rows in plans:
        micro = pack(batch.prompt_ids, batch.rollout.completion_ids, batch.rollout.completion_mask, rows,
                     trainer.pad_id, trainer.layout, keep_router=True)
        forward_hidden(model, micro)
        step_loss = step_loss + router_aux_loss(micro, model.config.num_experts) * len(rows)
    (coef * step_loss / len(batch.rows)).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(expected) <= set(with_aux) == set(without)
    scale = max(float(g.abs().max()) for g in without.values())
    for name, g in with_aux.items():
        want = expected.get(name, torch.zeros_like(g))
        torch.testing.assert_close(g - without[name], want, rtol=0, atol=1e-5 * scale, msg=name)
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-2 * scale  # the term is not negligible here
