"""Issue 5's update-phase machinery against independent computations: the chunked LM head (values and
gradients), length-bucketed right-padded micro-batches, micro-batch invariance of the update, the
out-of-memory retry, fp32 master weights, and activation checkpointing."""

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.update.logprobs import lm_head_logprobs, micro_batch_logprobs, rollout_logprobs, selected_logprobs
from cohort_grpo.rollout.layout import plan_micro_batches
from cohort_grpo.update.packing import pack_micro_batch
from cohort_grpo.optim.precision import MasterWeightAdamW
from cohort_grpo.optim.optimizer import make_optimizer
from helpers import synthetic_batch as _synthetic_batch, update_trainer as _trainer, variable_batch as _variable_batch
from update_gradients import update_gradient

# ---- chunked LM head ------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_lm_head_matches_plain_values_and_gradients(temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=g, requires_grad=True)
    weight = torch.randn(37, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 37, (11,), generator=g)
    g_logp, g_ent = torch.randn(11, generator=g), torch.randn(11, generator=g)

    logp, ent = lm_head_logprobs(hidden, weight, tokens, temperature, chunk_rows=3)  # 4 chunks, last one short
    (logp * g_logp + ent * g_ent).sum().backward()
    chunked = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    # independent: float64, full log-softmax, autograd
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    log_p = torch.log_softmax(h64 @ w64.T / temperature, dim=-1)
    want_logp = log_p.gather(1, tokens[:, None]).squeeze(1)
    want_ent = -(log_p.exp() * log_p).sum(-1)
    (want_logp * g_logp.double() + want_ent * g_ent.double()).sum().backward()

    assert torch.allclose(logp.double(), want_logp, atol=1e-5)
    assert torch.allclose(ent.double(), want_ent, atol=1e-5)
    assert torch.allclose(chunked[0].double(), h64.grad, atol=1e-5)
    assert torch.allclose(chunked[1].double(), w64.grad, atol=1e-5)


def test_chunked_lm_head_without_entropy_gradient_and_frozen_weight():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 8, generator=g, requires_grad=True)
    weight = torch.randn(13, 8, generator=g)  # a frozen head (LoRA, reference): no weight gradient
    tokens = torch.randint(0, 13, (5,), generator=g)
    logp, _ = lm_head_logprobs(hidden, weight, tokens, chunk_rows=2)
    logp.sum().backward()
    plain = hidden.detach().clone().requires_grad_(True)
    selected_logprobs(plain @ weight.T, tokens)[0].sum().backward()
    assert torch.allclose(hidden.grad, plain.grad, atol=1e-6)


# ---- micro-batch planning and packing -----------------------------------------------------------

def test_plan_micro_batches_covers_each_row_once_within_budgets():
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 50, (40,), generator=g).tolist()
    plans = plan_micro_batches(lengths, max_rows=6, max_tokens=120)
    assert sorted(i for p in plans for i in p) == list(range(40))
    for plan in plans:
        assert len(plan) <= 6
        assert len(plan) == 1 or len(plan) * max(lengths[i] for i in plan) <= 120
    flat = [lengths[i] for p in plans for i in p]
    assert flat == sorted(lengths, reverse=True)  # longest first: neighbours share a micro-batch
    assert plan_micro_batches([300, 2], max_rows=4, max_tokens=100) == [[0], [1]]  # a too-long row alone
    padded = sum(len(p) * max(lengths[i] for i in p) for p in plans)
    in_order = sum(6 * max(lengths[s:s + 6]) for s in range(0, 40, 6))
    assert padded < in_order  # bucketing pads less than taking rows in their order


def _row_logprobs_unpadded(model, prompt, completion):
    """The independent computation: one row, no padding at all, a plain full-vocab log-softmax."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).double()[0]
    log_p = torch.log_softmax(logits, dim=-1)
    return torch.stack([log_p[len(prompt) - 1 + t, tok] for t, tok in enumerate(completion)])


def test_packed_chunked_logprobs_equal_unpadded_per_row_computation(tiny_dir):
    from cohort_grpo.models import from_pretrained

    model = from_pretrained(tiny_dir, dtype="float32").eval()
    prompt_ids, completion, mask = _variable_batch(model.config.vocab_size)
    got = rollout_logprobs(model, prompt_ids, completion, mask, pad_id=0, max_rows=3, max_tokens=20)
    for i, prompt in enumerate(prompt_ids):
        n = int(mask[i].sum())
        want = _row_logprobs_unpadded(model, prompt, completion[i, :n].tolist())
        assert torch.allclose(got[i, :n].double(), want, atol=1e-5), i
        assert torch.all(got[i, n:] == 0)
    # one micro-batch of every row (the most padding) gives the same numbers
    micro = pack_micro_batch(prompt_ids, completion, mask, list(range(len(prompt_ids))), pad_id=0)
    with torch.no_grad():
        whole = micro_batch_logprobs(model, micro, chunk_rows=4).logp
    assert torch.allclose(whole, got[:, : whole.shape[1]], atol=1e-5)


# ---- the update: micro-batch invariance, OOM retry, checkpointing ------------------------------

@pytest.mark.cpu("gradients compared at float32 tolerances")
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_update_gradient_is_independent_of_micro_batching(tiny_dir, tmp_path, loss_type):
    trainer = _trainer(tiny_dir, tmp_path, loss_type=loss_type)
    with torch.no_grad():  # a reference unlike the policy, so the KL term has a gradient too
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = _synthetic_batch(trainer)
    trainer.memory.micro_rows, trainer.memory.micro_tokens = 16, 0
    whole, whole_stats = update_gradient(trainer, batch)
    trainer.memory.micro_rows, trainer.memory.micro_tokens = 3, 24
    bucketed, bucketed_stats = update_gradient(trainer, batch)
    assert bucketed_stats["micro_batches"] > whole_stats["micro_batches"] == 1
    assert whole.abs().sum() > 0
    assert torch.allclose(whole, bucketed, atol=1e-5)
    assert bucketed_stats["loss"] == pytest.approx(whole_stats["loss"], abs=1e-5)


@pytest.mark.cpu("gradients compared at float32 tolerances")
def test_gradient_checkpointing_gives_the_same_gradient(tiny_dir, tmp_path):
    plain = _trainer(tiny_dir, tmp_path / "a")
    checkpointed = _trainer(tiny_dir, tmp_path / "b", gradient_checkpointing=True)
    assert checkpointed.model.gradient_checkpointing and not plain.model.gradient_checkpointing
    batch = _synthetic_batch(plain)
    assert torch.allclose(update_gradient(plain, batch)[0], update_gradient(checkpointed, batch)[0], atol=1e-6)


@pytest.mark.cpu("gradients compared at float32 tolerances")
def test_checkpointing_the_first_layers_recomputes_only_those_and_gives_the_same_gradient(tiny_dir, tmp_path):
    plain = _trainer(tiny_dir, tmp_path / "a")
    partial = _trainer(tiny_dir, tmp_path / "b", gradient_checkpointing=True, gradient_checkpointing_layers=1)
    calls = [0] * len(partial.model.model.layers)
    for i, layer in enumerate(partial.model.model.layers):  # a recomputation starts the layer's forward again
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    batch = _synthetic_batch(plain)
    forwards_before = list(calls)  # the π_ref / π_old passes above used the other model
    want, _ = update_gradient(plain, batch)
    got, stats = update_gradient(partial, batch)
    assert torch.allclose(want, got, atol=1e-6)
    done = [c - b for c, b in zip(calls, forwards_before)]
    micro = stats["micro_batches"]
    assert done == [2 * micro] + [micro] * (len(done) - 1)  # layer 0 forward + recompute; the rest once


@pytest.mark.cpu("the CPU's checkpointing plan (a GPU measures its own)")
def test_gradient_checkpointing_layers_errors(tiny_dir, tmp_path):
    with pytest.raises(CohortError, match="gradient_checkpointing_layers=-1 is negative"):
        GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_layers=-1).validate()
    with pytest.raises(CohortError, match="does nothing without gradient_checkpointing"):
        GRPOConfig(gradient_checkpointing=False, gradient_checkpointing_layers=2).validate()
    with pytest.raises(CohortError, match=r"gradient_checkpointing_layers=1 needs cohort's engine \(model_impl auto or cohort\); LlamaForCausalLM"):
        _trainer(tiny_dir, tmp_path, model_impl="hf", gradient_checkpointing=True, gradient_checkpointing_layers=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_frees_the_gradients_after_its_step(tiny_dir, tmp_path, dtype):
    """Gradients (fp32 masters' included) do not stay allocated through the next rollout."""
    trainer = _trainer(tiny_dir, tmp_path, dtype=dtype)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.update(_synthetic_batch(trainer))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # the step happened
    assert all(p.grad is None for p in trainer.model.parameters())
    masters = getattr(trainer.optimizer, "masters", [])
    assert (len(masters) > 0) == (dtype == "bfloat16")
    assert all(m.grad is None for m in masters)


@pytest.mark.cpu("the CPU's micro-batch plan (a GPU cuts micro-batches by FLOPs) and float32 updates")
def test_out_of_memory_halves_the_micro_batch_and_matches_that_size_from_the_start(tiny_dir, tmp_path, monkeypatch):
    import cohort_grpo.update.policy_update as update_module

    real = update_module.micro_batch_policy_loss
    seen = []

    def limited(model, micro, **kwargs):  # a "GPU" that holds at most 4 rows per training micro-batch
        seen.append(len(micro.rows))
        if torch.is_grad_enabled() and len(micro.rows) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, micro, **kwargs)

    lines = []
    retried = _trainer(tiny_dir, tmp_path / "retry", per_device_train_batch_size=16, gradient_accumulation_steps=1)
    retried.log = lines.append
    monkeypatch.setattr(update_module, "micro_batch_policy_loss", limited)
    batch = _synthetic_batch(retried)
    stats = retried.update(batch)
    monkeypatch.setattr(update_module, "micro_batch_policy_loss", real)
    assert retried.memory.micro_rows == 4 and retried.memory.oom_retries == 2  # 16 → 8 → 4
    assert any("out of GPU memory with micro-batches of 16" in line for line in lines)
    assert max(seen) == 16 and stats["micro_batches"] == 4

    fresh = _trainer(tiny_dir, tmp_path / "fresh", per_device_train_batch_size=4, gradient_accumulation_steps=4)
    fresh.update(batch)
    for a, b in zip(retried.model.parameters(), fresh.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(retried.model.parameters(), retried.ref_model.parameters()))


@pytest.mark.cpu("the CPU optimizer's chunked step and float32 updates (a GPU steps with one kernel a parameter)")
def test_out_of_memory_in_the_optimizer_step_halves_its_chunks_and_the_update_is_the_same(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    """bf16 weights (fp32 masters) on the CPU, one tensor's fp32 bytes a chunk at most 64 KiB: the
    second chunk's master cannot be rebuilt once. The trainer logs the halving, counts it as a retry,
    and ends the update with the weights of a run that never ran out of memory."""
    import cohort_grpo.optim.precision as precision

    lines = []
    retried = _trainer(tiny_dir, tmp_path / "retry", dtype="bfloat16")
    retried.log = lines.append
    retried.optimizer.shrink_chunks(2 * 65536)  # the test's budget, before any update
    chunks_before, shrinks_before = len(retried.optimizer.chunks), retried.optimizer.chunk_shrinks
    assert chunks_before > 2
    real, calls = precision.join_master, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == len(retried.optimizer.chunks[0]) + 1:  # the second chunk's first master
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(precision, "join_master", failing)
    batch = _synthetic_batch(retried)
    retried.update(batch)
    monkeypatch.setattr(precision, "join_master", real)
    assert retried.memory.oom_retries == 1 and retried.optimizer.chunk_shrinks == shrinks_before + 1
    assert len(retried.optimizer.chunks) > chunks_before
    assert any("out of GPU memory in the optimizer step" in line for line in lines)

    fresh = _trainer(tiny_dir, tmp_path / "fresh", dtype="bfloat16")
    fresh.optimizer.shrink_chunks(2 * 65536)
    fresh.update(batch)
    for a, b in zip(retried.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(retried.optimizer.master_weights(), fresh.optimizer.master_weights()))


# ---- fp32 master weights -----------------------------------------------------------------------

def test_master_weights_keep_updates_bf16_alone_would_round_away():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    optimizer = make_optimizer(torch.nn.Linear(1, 1).to(torch.bfloat16).requires_grad_(True), _Args(1e-4))
    assert isinstance(optimizer, MasterWeightAdamW)
    optimizer = MasterWeightAdamW([weight], lr=1e-4)
    reference = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    exact = torch.optim.AdamW([reference], lr=1e-4)
    bf16_only = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    plain = torch.optim.AdamW([bf16_only], lr=1e-4)
    for _ in range(20):
        for p in (weight, reference, bf16_only):
            p.grad = torch.ones_like(p)
        optimizer.step(), exact.step(), plain.step()
    # 20 steps of 1e-4 from 1.0: 0.998, exactly held by the fp32 masters and rounded once into bf16
    assert torch.allclose(optimizer.master_weight(0).double(), reference.detach(), atol=1e-6)
    assert torch.equal(weight.detach(), reference.detach().to(torch.bfloat16))
    assert torch.all(bf16_only.detach() == 1.0)  # each 1e-4 step is below bf16's spacing near 1 (2⁻⁷)


def test_master_weights_round_trip_through_state_dict():
    weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    optimizer = MasterWeightAdamW([weight], lr=1e-3)
    for _ in range(3):
        weight.grad = torch.full_like(weight, 0.5)
        optimizer.step()
    state = optimizer.state_dict()
    other_weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    other = MasterWeightAdamW([other_weight], lr=1e-3)
    other.load_state_dict(state)
    assert torch.equal(other.master_weight(0), optimizer.master_weight(0))  # the fp32 values, not their bf16 rounding
    assert torch.equal(other_weight, weight)
    for opt, w in ((optimizer, weight), (other, other_weight)):
        w.grad = torch.full_like(w, 0.5)
        opt.step()
    assert torch.equal(other.master_weight(0), optimizer.master_weight(0))


class _Args:
    def __init__(self, lr):
        self.learning_rate, self.weight_decay, self.adam_beta1, self.adam_beta2 = lr, 0.0, 0.9, 0.999
        self.optimizer_state_dtype, self.offload_optimizer, self.seed = "auto", False, 0


def test_compiled_training_layers_give_the_same_gradient(tiny_dir, tmp_path):
    """torch.compile of the training layer (inductor's C++ backend on CPU): same gradient as eager,
    compiled once for all layers and micro-batch shapes, with and without checkpointing."""
    import torch._dynamo

    eager = _trainer(tiny_dir, tmp_path / "a")
    batch = _synthetic_batch(eager)
    eager.micro_rows, eager.micro_tokens = 5, 0  # micro-batches of different lengths
    want = update_gradient(eager, batch)[0]
    torch._dynamo.reset()
    for checkpointing in (False, True):
        compiled = _trainer(tiny_dir, tmp_path / f"c{checkpointing}", torch_compile=True,
                            gradient_checkpointing=checkpointing)
        compiled.micro_rows, compiled.micro_tokens = 5, 0
        got = update_gradient(compiled, batch)[0]
        assert not compiled.model.training_layer_call.failed
        assert torch.allclose(got, want, atol=1e-5)


def test_compiled_lm_head_chunk_math_equals_plain():
    """The fused (torch.compile) forward and backward of one LM-head chunk against the plain ops;
    on a GPU the compiled ones run, so they are checked here with inductor's CPU backend."""
    from cohort_grpo.update.logprobs import _chunk_backward, _chunk_forward

    g = torch.Generator().manual_seed(3)
    logits, tokens = torch.randn(7, 50, generator=g), torch.randint(0, 50, (7,), generator=g)
    g_logp, g_ent = torch.randn(7, generator=g), torch.randn(7, generator=g)
    plain_fwd = _chunk_forward(logits, tokens, 1 / 0.7)
    fused_fwd = torch.compile(_chunk_forward, dynamic=True)(logits, tokens, 1 / 0.7)
    for a, b in zip(plain_fwd, fused_fwd):
        assert torch.allclose(a, b, atol=1e-5)
    _, ent, lse = plain_fwd
    args = (logits, tokens, lse, ent, g_logp, g_ent, 1 / 0.7)
    assert torch.allclose(_chunk_backward(*args), torch.compile(_chunk_backward, dynamic=True)(*args), atol=1e-5)
