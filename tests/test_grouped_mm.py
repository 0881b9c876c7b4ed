"""The grouped expert product against a Python loop over experts: values and gradients."""

import pytest
import torch

from cohort_grpo.kernels.grouped_mm import grouped_linear, native_serves, padded_grouped_linear

torch.set_num_threads(1)


def _loop(x, weight, counts):
    """The per-expert reference: each expert's rows times its matrix, one expert at a time."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start: start + n] @ weight[e].T)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("product", [grouped_linear, padded_grouped_linear])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0], [1, 1, 1, 1]])
def test_grouped_product_equals_expert_loop(product, counts):
    generator = torch.Generator().manual_seed(sum(counts) + len(counts))
    x = torch.randn(sum(counts), 16, generator=generator, requires_grad=True)
    weight = torch.randn(len(counts), 8, 16, generator=generator, requires_grad=True)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    upstream = torch.randn(sum(counts), 8, generator=generator)
    out = product(x, weight, offsets)
    (out * upstream).sum().backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    expected = _loop(x, weight, counts)
    (expected * upstream).sum().backward()
    assert (out - expected).abs().max() <= 1e-5
    assert (grads[0] - x.grad).abs().max() <= 1e-5
    assert (grads[1] - weight.grad).abs().max() <= 1e-5
    if counts[1] == 0:
        assert grads[1][1].abs().max() == 0  # an expert without rows gets no gradient


def test_native_product_takes_a_broadcast_gradient():
    """`.sum().backward()` hands the product a stride-0 gradient, which torch's grouped GEMM refuses as is."""
    x = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(2, 8, 16, requires_grad=True)
    assert native_serves(x, weight)
    grouped_linear(x, weight, torch.tensor([4, 6], dtype=torch.int32)).sum().backward()
    assert torch.allclose(weight.grad[0], torch.ones(8, 4) @ x[:4].detach(), atol=1e-5)


def test_unaligned_shapes_take_the_padded_product():
    x, weight = torch.randn(5, 3), torch.randn(2, 4, 3)
    assert not native_serves(x, weight)
    counts = [2, 3]
    out = grouped_linear(x, weight, torch.tensor(counts).cumsum(0).to(torch.int32))
    assert (out - _loop(x, weight, counts)).abs().max() <= 1e-5
