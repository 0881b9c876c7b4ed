"""The trainer's seams: the run lifecycle gives the signal handlers back even when training raises;
the loss the default path runs is `objectives.policy_loss` (the fused head only supplies its
log-probs), and the fused and plain log-prob backends give the same loss and gradients through it;
the prompt stream restores exactly; advantage estimation is a step the loop calls."""

import signal

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.algorithm import objectives
from cohort_grpo.tasks.prompts import PromptStream
from cohort_grpo.update import fused_head
from cohort_grpo.update.fused_head import FusedHead
from cohort_grpo.update.logprobs import micro_batch_logprobs
from helpers import UPDATE_PROMPTS, always_one, update_trainer, variable_batch


class Broken(RuntimeError):
    pass


def test_signal_handlers_are_restored_when_training_raises(tiny_dir, tmp_path):
    def mine(signum, frame):
        pass

    previous = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        class FailsInStep2(GRPOTrainer):
            def update_step(self, batch):
                if self.step == 2:
                    assert signal.getsignal(signal.SIGINT) is not mine  # the run's own handler is in place
                    raise Broken("step 2")
                return super().update_step(batch)

        trainer = FailsInStep2(tiny_dir, always_one, UPDATE_PROMPTS, args=GRPOConfig(
            num_generations=4, per_device_train_batch_size=8, max_completion_length=4, max_steps=3,
            output_dir=str(tmp_path), quiet=True, save_steps=0))
        with pytest.raises(Broken):
            trainer.train()
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        assert len(trainer.history) == 1  # step 1 really ran inside the lifecycle
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_the_default_path_computes_its_loss_with_objectives_policy_loss(tiny_dir, tmp_path, monkeypatch):
    """Every micro-batch's loss comes from the objectives module's function, given the fused head."""
    calls = []
    real = fused_head.policy_loss

    def counting(logp, *args, **kwargs):
        calls.append(type(logp).__name__)
        return real(logp, *args, **kwargs)

    monkeypatch.setattr(fused_head, "policy_loss", counting)
    trainer = update_trainer(tiny_dir, tmp_path, max_steps=2)
    assert trainer.args.fused_head_loss  # the default
    trainer.train()
    history = trainer.history
    assert len(calls) == sum(h["micro_batches"] for h in history) > 0
    assert set(calls) == {"FusedHead"}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_fused_and_plain_backends_give_one_loss_and_gradient_through_policy_loss(tiny_dir, tmp_path, loss_type):
    from cohort_grpo.models import from_pretrained
    from cohort_grpo.update.packing import pack_micro_batch

    torch.manual_seed(0)
    model = from_pretrained(tiny_dir, dtype="float32").train()
    prompt_ids, completion, mask = variable_batch(model.config.vocab_size, seed=3, rows=6)
    micro = pack_micro_batch(prompt_ids, completion, mask, list(range(6)), pad_id=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current = micro_batch_logprobs(model, micro).logp
    old = (current + 0.5 * torch.randn(mask.shape, generator=g)) * mask
    ref = (current + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    advantages = torch.randn(6, generator=g)
    spec = objectives.LossSpec(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type,
                               max_completion_length=mask.shape[1], entropy_coef=0.01)
    share = objectives.BatchShare(6, 6, float(mask.sum()))
    results = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        if fused:
            out = objectives.policy_loss(FusedHead(model, micro, chunk_rows=4), old, advantages, mask, spec, ref_logp=ref,
                                         share=share)
        else:
            lp = micro_batch_logprobs(model, micro, with_entropy=True)
            out = objectives.policy_loss(lp.logp, old, advantages, mask, spec, ref_logp=ref, entropy=lp.entropy,
                                         share=share)
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (fused_out, fused_grads), (plain_out, plain_grads) = results
    assert fused_out.loss.item() == pytest.approx(plain_out.loss.item(), abs=1e-6)
    assert torch.allclose(fused_out.logp, plain_out.logp, atol=1e-5)
    assert torch.allclose(fused_out.entropy, plain_out.entropy, atol=1e-5)
    for key in plain_out.stats:
        assert fused_out.stats[key].item() == pytest.approx(plain_out.stats[key].item(), abs=1e-6), key
    assert fused_grads.keys() == plain_grads.keys() and len(plain_grads) > 0
    for name in plain_grads:
        assert torch.allclose(fused_grads[name], plain_grads[name], atol=1e-5), name
    assert fused_out.stats["clip_ratio/region_mean"] > 0  # the clip binds somewhere: the comparison is not trivial


def test_policy_loss_refuses_a_sequence_ratio_through_a_fused_head(tiny_dir):
    with pytest.raises(ValueError, match="sequence ratio"):
        objectives.policy_loss(object(), None, torch.zeros(2), torch.ones(2, 3),
                               objectives.LossSpec(importance_sampling_level="sequence"))


def test_prompt_stream_walks_epochs_and_restores_exactly():
    rows = [{"prompt": str(i)} for i in range(5)]
    stream = PromptStream(rows, rows_per_step=3, seed=7)
    first = [r["prompt"] for r in stream.next_rows()] + [r["prompt"] for r in stream.next_rows()]
    assert sorted(first[:5]) == [str(i) for i in range(5)]  # one whole epoch before any repeat
    state = stream.state_dict()
    later = [stream.next_rows(), stream.next_seed(), stream.next_rows()]
    stream.load_state_dict(state)
    assert [stream.next_rows(), stream.next_seed(), stream.next_rows()] == later
    before = stream.state_dict()
    with stream.unchanged():
        stream.next_rows(), stream.next_seed()
        assert stream.state_dict() != before  # the block did draw
    assert stream.state_dict() == before  # and left no trace


def test_advantage_estimation_is_the_loop_s_step(tiny_dir, tmp_path):
    """A trainer that estimates advantages its own way changes what the update sees, and nothing else
    writes them: every completion sample's advantage is the subclass's."""
    class ConstantAdvantages(GRPOTrainer):
        def estimate_advantages(self, batch):
            return torch.full((len(batch.rows),), 0.25)

    trainer = ConstantAdvantages(tiny_dir, always_one, UPDATE_PROMPTS, args=GRPOConfig(
        num_generations=4, per_device_train_batch_size=8, max_completion_length=4, max_steps=1,
        output_dir=str(tmp_path), quiet=True, save_steps=0))
    trainer.train()
    from cohort_grpo.telemetry.metrics import read_completions

    samples = read_completions(tmp_path)
    assert samples and all(s["advantage"] == 0.25 for s in samples)
    assert all(s["reward"] == 1.0 for s in samples)  # GRPO's own estimate here would be 0 for every completion
