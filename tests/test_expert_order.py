"""The decode step's expert order (cohort_grpo.kernels.expert_order) against torch's stable sort and search.

Without CUDA the kernel runs in Triton's interpreter. Routings with many ties (few experts), experts without
copies, more copies than one block holds, and an expert count that is not a power of two."""

import pytest
import torch
from triton_interpreter import DEVICE, kernel_module

pytest.importorskip("triton", reason="triton is not installed; the expert-order kernel cannot run")
ordering = kernel_module("cohort_grpo.kernels.expert_order", "_expert_order_kernel")


@pytest.mark.parametrize("tokens, top_k, experts, used", [
    (3, 2, 8, 8),  # a decode step of 3 sequences
    (64, 8, 128, 128),  # 64 sequences of Qwen3-30B-A3B's routing
    (700, 2, 5, 3),  # 1,400 copies: two blocks of 1,024; experts 3 and 4 receive none; 5 experts
    (1, 4, 60, 2),  # one token, its 4 copies among 2 experts (ties within the row)
])
def test_the_order_is_the_stable_sort_and_the_ends_are_the_searchsorted_ones(tokens, top_k, experts, used):
    generator = torch.Generator().manual_seed(tokens * 31 + experts)
    ids = torch.randint(0, used, (tokens, top_k), generator=generator)
    order, token_of, ends = ordering.expert_order(ids.to(DEVICE), experts, top_k)
    flat = ids.reshape(-1)
    expected = torch.argsort(flat, stable=True)
    assert torch.equal(order.cpu(), expected)
    assert torch.equal(token_of.cpu(), expected // top_k)
    expected_ends = torch.searchsorted(flat[expected], torch.arange(experts), right=True).to(torch.int32)
    assert torch.equal(ends.cpu(), expected_ends) and ends.dtype == torch.int32


def test_no_copies_gives_empty_orders_and_zero_ends():
    order, token_of, ends = ordering.expert_order(torch.empty(0, 8, dtype=torch.int64, device=DEVICE), 4, 8)
    assert order.numel() == token_of.numel() == 0 and torch.equal(ends.cpu(), torch.zeros(4, dtype=torch.int32))


@pytest.mark.skipif(DEVICE != "cuda", reason="the sampling path takes Triton kernels on CUDA only")
def test_a_moe_layer_s_sampling_forward_orders_its_copies_by_the_kernel_with_the_same_output(monkeypatch):
    """Under the engine's fused kernels and autograd off, a MoE block's copies take `expert_order` up to
    THIN_ROWS_PER_EXPERT copies an expert and torch's sort above; the block's output is the same bits either way."""
    from cohort_grpo.kernels.elementwise import fused_kernels
    from cohort_grpo.kernels.grouped_mm import THIN_ROWS_PER_EXPERT
    from cohort_grpo.models import moe
    from cohort_grpo.models.config import ModelConfig

    config = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    torch.manual_seed(0)
    block = moe.SparseMoeBlock(config, 0).to(torch.bfloat16).cuda()
    taken = []
    monkeypatch.setattr(moe, "expert_order", lambda ids, *rest: taken.append(ids.numel()) or
                        ordering.expert_order(ids, *rest))
    most = THIN_ROWS_PER_EXPERT * 8 // 2  # tokens: 2 copies each
    outputs = {}
    for tokens in (3, most, most + 1):
        x = torch.randn(1, tokens, 64, device="cuda").to(torch.bfloat16)
        with torch.inference_mode(), fused_kernels(True):
            outputs[tokens] = block(x), x
    assert taken == [6, 2 * most]
    monkeypatch.setattr(moe, "decode_sized", lambda *_: False)  # torch's sort and search, the products unchanged
    for tokens, (sampled, x) in outputs.items():
        with torch.inference_mode(), fused_kernels(True):
            assert torch.equal(block(x), sampled)
    assert taken == [6, 2 * most]
