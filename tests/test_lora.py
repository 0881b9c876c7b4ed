"""LoRA through peft: only adapters train, π_ref is the same model with adapters off (no copy), the
engine samples with the adapters, and the saved folder (merged weights + peft adapter) loads back."""

import pytest
import torch

peft = pytest.importorskip("peft", reason="LoRA needs peft (pip install -e '.[test]' installs it)")

from cohort_grpo import GRPOConfig, GRPOTrainer# noqa: E402
from cohort_grpo.errors import CohortError# noqa: E402
from cohort_grpo.models.lora import adapters_disabled# noqa: E402
from cohort_grpo.update.logprobs import rollout_logprobs# noqa: E402
from cohort_grpo.models import from_pretrained# noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams# noqa: E402

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]


pytestmark = pytest.mark.cpu("float32 logits of a CPU reference model compared at 1e-5, and bitwise resumes")


def first_char_digit(completions, **kwargs):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def _trainer(tiny_dir, tmp_path, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                max_completion_length=5, max_steps=2, learning_rate=5e-2, output_dir=str(tmp_path), quiet=True,
                seed=0, beta=0.04, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, save_steps=1)
    base.update(overrides)
    return GRPOTrainer(tiny_dir, first_char_digit, PROMPTS, args=GRPOConfig(**base))


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def test_lora_trains_adapters_only_and_reference_is_the_base_model(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    assert trainer.ref_model is None  # no second copy of the weights
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base_before.items())
    assert any(not torch.all(p == 0) for n, p in after.items() if "lora_B" in n)  # B starts at 0 and moved
    assert trainer.history[-1]["kl"] > 0  # the policy left the reference

    # π_ref = adapters off = the untouched base model, computed independently from the folder
    original = from_pretrained(tiny_dir, dtype="float32").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    with adapters_disabled(trainer.model):
        assert torch.allclose(_logits(trainer.model, ids), _logits(original, ids), atol=1e-5)
    assert not torch.allclose(_logits(trainer.model, ids), _logits(original, ids), atol=1e-3)

    # the engine samples from base + adapters: greedy tokens equal a full forward's argmax chain. On a
    # GPU the engine first fuses q/k/v and gate/up into single matrices; that must leave LoRA layers be.
    trainer.model.fuse_projections()
    assert all(layer.self_attn.fused_qkv is None and layer.mlp.fused_gate_up is None
               for layer in trainer.model.model.layers)
    prompt = [3, 5, 7]
    rollout = trainer.sampler.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0.0))
    seq = list(prompt)
    for _ in range(4):
        seq.append(int(_logits(trainer.model, torch.tensor([seq]))[0, -1].argmax()))
    assert rollout.completion_ids[0, : int(rollout.completion_mask[0].sum())].tolist() == seq[3:3 + int(rollout.completion_mask[0].sum())]


def test_lora_folder_loads_merged_in_transformers_and_as_peft_adapter(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_dir, tmp_path)
    trainer.train()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    want = _logits(trainer.model, ids)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert torch.allclose(_logits(adapted, ids), want, atol=1e-5)


@pytest.mark.slow
def test_lora_resume_restores_adapters_exactly(tiny_dir, tmp_path):
    full = _trainer(tiny_dir, tmp_path / "full", max_steps=3)
    full.train()
    partial = _trainer(tiny_dir, tmp_path / "part", max_steps=2, save_total_limit=0)
    partial.train()
    resumed = _trainer(tiny_dir, tmp_path / "part", max_steps=3, resume=True)
    resumed.train()
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_lora_reference_logprobs_equal_base_model_logprobs(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path)
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # adapters that change the policy a lot
    batch = trainer.sample(trainer.next_prompts())
    batch.old_logp, batch.ref_logp = trainer.reference_logprobs(batch)
    original = from_pretrained(tiny_dir, dtype="float32").eval()
    want = rollout_logprobs(original, batch.prompt_ids, batch.rollout.completion_ids, batch.rollout.completion_mask,
                            pad_id=trainer.pad_id, max_rows=64)
    assert torch.allclose(batch.ref_logp, want, atol=1e-5)


def test_lora_bad_targets_fail_clearly(tiny_dir, tmp_path):
    with pytest.raises(CohortError, match="match no module"):
        _trainer(tiny_dir, tmp_path / "a", lora_target_modules=["qkv"])


@pytest.mark.slow
def test_lora_reference_reset_folds_the_adapters_into_the_base(tiny_dir, tmp_path):
    """π_ref ← π_θ with LoRA: the policy is unchanged, 'adapters off' becomes it, B restarts at 0."""
    trainer = _trainer(tiny_dir, tmp_path)
    trainer.train()
    ids = torch.tensor([[3, 5, 7, 9, 11, 4]])
    policy = _logits(trainer.model, ids)
    with adapters_disabled(trainer.model):
        assert not torch.allclose(_logits(trainer.model, ids), policy, atol=1e-3)  # π_ref ≠ π_θ before
    trainer.reset_reference()
    assert torch.allclose(_logits(trainer.model, ids), policy, atol=1e-5)
    with adapters_disabled(trainer.model):
        assert torch.allclose(_logits(trainer.model, ids), policy, atol=1e-5)
    assert all(torch.all(p == 0) for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_lora_resume_across_reference_resets_is_exact(tiny_dir, tmp_path):
    full = _trainer(tiny_dir, tmp_path / "full", max_steps=5, ref_reset_steps=2)
    full.train()
    _trainer(tiny_dir, tmp_path / "part", max_steps=3, ref_reset_steps=2, save_total_limit=0).train()
    resumed = _trainer(tiny_dir, tmp_path / "part", max_steps=5, ref_reset_steps=2, resume=True)
    resumed.train()
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
