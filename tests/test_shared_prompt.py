"""Shared-prompt packing (cohort_grpo/update/packing.py, cohort_grpo/models/shared_prefix.py): one flat, unpadded
sequence with each prompt once, then its completions; attention over per-completion index rows.
Checked against independent computations: the layout against hand-built rows, log-probs against
transformers' own model run on each (prompt, completion) alone, the update's loss and gradients
against the one-row-per-completion layout, and a trainer step with the option on and off."""

import pytest
import torch
from reference_models import save_perturbed_references
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.algorithm.loss_spec import BatchShare, LossSpec
from cohort_grpo.update.fused_head import micro_batch_policy_loss
from cohort_grpo.update.logprobs import micro_batch_logprobs, rollout_logprobs
from cohort_grpo.models import from_pretrained
from cohort_grpo.rollout.layout import Layout
from cohort_grpo.update.packing import pack_micro_batch, pack_shared_prompts

torch.set_num_threads(1)
SHARED = Layout(shared=True, group=4)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY),
    "qwen2_bias_sliding": lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3_qk_norm": lambda: Qwen3Config(**TINY, head_dim=32),
    "mistral_sliding": lambda: MistralConfig(**TINY, sliding_window=5),
}


def _groups(vocab: int, prompts: int = 3, per_prompt: int = 3, seed: int = 0):
    """A rollout of `prompts` prompts of different lengths, `per_prompt` completions each (one of
    them empty), rows interleaved so a prompt's rows are not adjacent."""
    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(1, vocab, (2 + 3 * p,), generator=g).tolist() for p in range(prompts)]
    prompt_ids = [distinct[i % prompts] for i in range(prompts * per_prompt)]
    lengths = [int(n) for n in torch.randint(1, 10, (len(prompt_ids),), generator=g)]
    lengths[4] = 0
    completion = torch.zeros(len(prompt_ids), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(completion)
    for i, n in enumerate(lengths):
        completion[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return prompt_ids, completion, mask


# ---- layout and planning -----------------------------------------------------------------------

def test_layout_puts_each_prompt_once_and_completions_after_it():
    prompt_ids = [[5, 6, 7], [9], [5, 6, 7]]
    completion = torch.tensor([[1, 2, 0], [3, 4, 8], [11, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    micro = pack_shared_prompts(prompt_ids, completion, mask, [0, 1, 2], pad_id=0)
    # flat: prompt A, completions 0 and 2, prompt B, completion 1; no padding
    assert micro.input_ids.tolist() == [[5, 6, 7, 1, 2, 11, 9, 3, 4, 8]]
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 3]]
    width = micro.attention_rows.shape[1]
    assert width == 5  # the longest [prompt | completion]
    flat = micro.input_ids[0]
    for i, r in enumerate([0, 1, 2]):  # each attention row is that completion's plain row
        n = int(mask[r].sum())
        row = flat[micro.attention_rows[i, : len(prompt_ids[r]) + n]].tolist()
        assert row == prompt_ids[r] + completion[r, :n].tolist()
    # every flat token reads its output from a slot holding that very token
    assert torch.equal(micro.attention_rows.view(-1)[micro.attention_slots], torch.arange(10))
    # (row, col) of the hidden state before each completion token, row-major over the completions
    assert micro.source_cols.tolist() == [2, 3, 6, 7, 8, 2] and micro.source_rows.tolist() == [0] * 6
    assert micro.completion_ids.tolist() == completion.tolist() and micro.rows == [0, 1, 2]


def test_plan_keeps_prompt_groups_together_within_budgets():
    prompt_ids, _, mask = _groups(vocab=50, prompts=4, per_prompt=4, seed=3)
    plans = SHARED.plan(prompt_ids, mask, max_rows=8, max_tokens=0)
    assert sorted(r for p in plans for r in p) == list(range(len(prompt_ids)))
    for plan in plans:
        assert len(plan) <= 8
        assert len({tuple(prompt_ids[r]) for r in plan}) == len(plan) // 4  # whole groups of 4
    # max_rows below the group size cuts a group into runs that each repeat the prompt
    small = SHARED.plan(prompt_ids, mask, max_rows=3)
    assert all(len(p) <= 3 for p in small) and sorted(r for p in small for r in p) == list(range(16))
    # the token cap counts a group as its prompt plus all its completions
    lengths = mask.sum(1).tolist()
    group_len = {tuple(p): len(p) for p in prompt_ids}
    for r, p in enumerate(prompt_ids):
        group_len[tuple(p)] += lengths[r]
    capped = SHARED.plan(prompt_ids, mask, max_rows=16, max_tokens=max(group_len.values()) + 1)
    assert all(len({tuple(prompt_ids[r]) for r in p}) == 1 for p in capped)


def test_shared_layout_has_fewer_tokens():
    prompt_ids, completion, mask = _groups(vocab=50)
    rows = list(range(len(prompt_ids)))
    shared = pack_shared_prompts(prompt_ids, completion, mask, rows, 0)
    plain = pack_micro_batch(prompt_ids, completion, mask, rows, 0)
    distinct = {tuple(p) for p in prompt_ids}
    assert shared.num_tokens == int(mask.sum()) + sum(len(p) for p in distinct)
    assert int((plain.input_ids != 0).sum()) == int(mask.sum()) + sum(len(p) for p in prompt_ids)


# ---- log-probs against transformers, row by row ----------------------------------------------

@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return {family: (reference, from_pretrained(folder, dtype="float32").eval())
            for family, (reference, folder) in save_perturbed_references(FAMILIES, tmp_path_factory).items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_logprobs_equal_transformers_on_each_row_alone(families, family):
    reference, model = families[family]
    prompt_ids, completion, mask = _groups(TINY["vocab_size"])
    got = rollout_logprobs(model, prompt_ids, completion, mask, pad_id=0, max_rows=9, layout=SHARED)
    for i, prompt in enumerate(prompt_ids):
        n = int(mask[i].sum())
        if n == 0:
            assert torch.all(got[i] == 0)
            continue
        ids = torch.tensor([prompt + completion[i, :n].tolist()])
        with torch.no_grad():
            log_p = torch.log_softmax(reference(ids).logits[0].double(), dim=-1)
        want = torch.stack([log_p[len(prompt) - 1 + t, completion[i, t]] for t in range(n)])
        assert torch.allclose(got[i, :n].double(), want, atol=1e-5), (family, i)
        assert torch.all(got[i, n:] == 0)


def test_attention_rows_refuse_a_padding_mask(families):
    _, model = families["llama"]
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(CohortError, match="attention_rows"):
        model(ids, attention_rows=torch.tensor([[0, 1, 2]]), attention_slots=torch.arange(3),
              attention_mask=torch.ones_like(ids))


# ---- the update: loss and gradients equal the per-completion layout ---------------------------

@pytest.mark.parametrize("fused,loss_type", [(True, "grpo"), (True, "dapo"), (False, "dr_grpo")])
def test_shared_layout_gives_the_same_loss_and_gradients(families, fused, loss_type):
    _, model = families["qwen2_bias_sliding"]
    model.train()
    prompt_ids, completion, mask = _groups(TINY["vocab_size"], seed=1)
    rows = list(range(len(prompt_ids)))
    g = torch.Generator().manual_seed(5)
    advantages = torch.randn(len(rows), generator=g)
    ref_logp = -torch.rand(mask.shape, generator=g) * mask
    old_logp = -torch.rand(mask.shape, generator=g) * mask
    results = []
    for packer in (pack_micro_batch, pack_shared_prompts):
        micro = packer(prompt_ids, completion, mask, rows, 0)
        model.zero_grad(set_to_none=True)
        (loss, stats) = out = micro_batch_policy_loss(
            model, micro, old_logp=old_logp, ref_logp=ref_logp, advantages=advantages, loss_mask=mask.float(),
            fused=fused, chunk_rows=7, share=BatchShare(len(rows), len(rows), float(mask.sum())),
            spec=LossSpec(beta=0.04, loss_type=loss_type, max_completion_length=mask.shape[1], entropy_coef=0.01))
        loss.backward()
        results.append((loss.detach(), out.logp, {k: v.detach() for k, v in stats.items()},
                        {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.eval()
    (loss_a, logp_a, stats_a, grads_a), (loss_b, logp_b, stats_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert torch.allclose(logp_a, logp_b, atol=1e-5)
    for key in stats_a:
        assert torch.allclose(stats_a[key], stats_b[key], atol=1e-5), key
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=1e-5), name
    assert any(g.abs().max() > 1e-4 for g in grads_a.values())  # a gradient that is really there


def test_micro_batch_logprobs_refuse_shared_rows_for_logits_only_models(families):
    reference, _ = families["llama"]
    prompt_ids, completion, mask = _groups(TINY["vocab_size"])
    micro = pack_shared_prompts(prompt_ids, completion, mask, [0, 3], 0)
    with pytest.raises(ValueError, match="one row per completion"):
        micro_batch_logprobs(reference, micro)


# ---- a trainer step, sharing on and off -------------------------------------------------------

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]


def _reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


@pytest.mark.slow
def test_trainer_step_is_the_same_with_and_without_sharing(tiny_dir, tmp_path):
    """One step each way from the same seed: the same rollout, metrics and gradient (read off AdamW's
    first moment, (1 − β1)·g after one step; the weights themselves move by ≈ lr·sign(g), which
    rounding may flip where g ≈ 0)."""
    history, tokens, moments = {}, {}, {}
    for share in (True, False):
        args = GRPOConfig(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                          max_completion_length=6, max_steps=1, learning_rate=1e-3, output_dir=str(tmp_path / str(share)),
                          quiet=True, seed=0, beta=0.04, share_prompt_prefix=share, save_steps=0, eval_steps=0,
                          dtype="float32")
        trainer = GRPOTrainer(tiny_dir, _reward_length, PROMPTS, args=args)
        assert trainer.layout == Layout(shared=share, group=4)
        packed = []
        original = trainer.policy_update.pack
        trainer.policy_update.pack = lambda batch, rows: packed.append(original(batch, rows)) or packed[-1]
        trainer.train()
        history[share] = trainer.history[0]
        tokens[share] = sum(m.num_tokens for m in packed)
        if share:  # the update's rate counts the tokens its forwards computed: each prompt once per group
            computed = sum(m.num_tokens for m in packed)  # no padding in this layout
            record = trainer.history[0]
            assert record["tokens_per_second/update"] * record["time/update"] == pytest.approx(computed, rel=1e-9)
        moments[share] = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
    for key in ("loss", "kl", "reward", "completions/mean_length", "entropy"):
        assert history[True][key] == pytest.approx(history[False][key], abs=1e-5), key
    assert len(moments[True]) == len(moments[False]) > 0
    for on, off in zip(moments[True], moments[False]):
        assert torch.allclose(on, off, atol=1e-7)
    assert max(m.abs().max() for m in moments[True]) > 1e-5  # a gradient that is really there
    assert tokens[True] < tokens[False]  # each prompt computed once per group, not per completion


# ---- CUDA: the same numbers through the GPU's attention kernels --------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_layout_equals_plain_layout_on_cuda(families):
    _, model = families["qwen3_qk_norm"]
    model = model.cuda()
    prompt_ids, completion, mask = _groups(TINY["vocab_size"], prompts=2, per_prompt=4)
    rows = list(range(8))
    with torch.no_grad():
        got = [micro_batch_logprobs(model, packer(prompt_ids, completion, mask, rows, 0).to("cuda")).logp
               for packer in (pack_shared_prompts, pack_micro_batch)]
    model.cpu()
    assert torch.allclose(got[0], got[1], atol=1e-4)
