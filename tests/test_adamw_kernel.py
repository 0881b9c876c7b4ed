"""The one-pass AdamW kernel (cohort_grpo/kernels/adamw.py) against AdamW written out in fp32 torch: the same
master, moments within one bf16 unit of the exact ones and right on average, the noise keyed by the seed
alone. On CPU it runs in Triton's interpreter; on a GPU (COHORT_TEST_GPU=1) the optimizer that uses it
is checked against the chunked torch step."""

import copy
import io

import pytest
import torch

from cohort_grpo.optim import precision
from cohort_grpo.optim.bf16 import join_master, split_master
from cohort_grpo.optim.precision import MasterWeightAdamW
from triton_interpreter import ON_CUDA, kernel_module

pytest.importorskip("triton")
DEVICE = "cuda" if ON_CUDA else "cpu"
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _inputs(n: int = 2048, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=generator) * torch.exp(torch.randn(n, generator=generator))
    weight, low = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_master(master.clone(), weight, low)
    grad = torch.randn(n, generator=generator).to(torch.bfloat16)
    m = (torch.randn(n, generator=generator) * 0.1).to(torch.bfloat16)
    v = (torch.rand(n, generator=generator) * 0.01).to(torch.bfloat16)
    return [t.to(DEVICE) for t in (weight, low, grad, m, v)]


def _reference(weight, low, grad, m, v, step: int, clip: float = 1.0):
    """AdamW written out in torch: the moments in fp32 (m as torch's lerp forms it, so a moment that
    cancels to 0 is 0), the master in float64."""
    h = HYPER
    master = join_master(weight.cpu(), low.cpu()).double()
    g, m, v = grad.cpu().float() * clip, m.cpu().float(), v.cpu().float()
    m = m + (1 - h["beta1"]) * (g - m)
    v = h["beta2"] * v + (1 - h["beta2"]) * g * g
    master = master * (1 - h["lr"] * h["weight_decay"])
    denom = v.double().sqrt() / (1 - h["beta2"] ** step) ** 0.5 + h["eps"]
    master = master - h["lr"] / (1 - h["beta1"] ** step) * m.double() / denom
    return master, m.double(), v.double()


def _step(module, tensors, step=3, seed=11, clip=None):
    weight, low, grad, m, v = [t.clone() for t in tensors]
    clip_tensor = None if clip is None else torch.tensor(clip, device=DEVICE)
    module.adamw_bf16_step(weight, low, grad, m, v, step=step, seed=seed, clip=clip_tensor, **HYPER)
    return weight, low, m, v


def _bf16_unit(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each value's magnitude, at least that at 1e-6: a moment that cancels
    to about 0 may come out 0 or a few fp32 units away, as the GPU fuses a multiply and an add."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(1e-6)))
    return torch.pow(2.0, exponent - 7)


@pytest.fixture(scope="module")
def module():
    return kernel_module("cohort_grpo.kernels.adamw", "_adamw_bf16_kernel")


@pytest.mark.parametrize("clip", [None, 0.25])
def test_the_master_is_adamw_in_fp32_and_is_split_as_split_master(module, clip):
    tensors = _inputs()
    weight, low, m, v = _step(module, tensors, clip=clip)
    master, m_ref, v_ref = _reference(*tensors, step=3, clip=1.0 if clip is None else clip)
    got = join_master(weight.cpu(), low.cpu()).double()
    error = ((got - master).abs() - 1e-6 * master.abs()).max().item()
    assert error <= 1e-8, f"master off by {error:.3g} beyond 1e-6 relative"  # fp32 arithmetic on steps of ~1e-2
    # The stored pair is split_master's split of that fp32 master, ties included.
    again_weight, again_low = torch.empty_like(weight.cpu()), torch.empty_like(low.cpu())
    split_master(got.float(), again_weight, again_low)
    assert torch.equal(again_weight, weight.cpu()) and torch.equal(again_low, low.cpu())
    # Each moment is one of the two bf16 values around the exact one.
    for rounded, exact in ((m, m_ref), (v, v_ref)):
        units = (rounded.cpu().double() - exact).abs() / _bf16_unit(exact.float()).double()
        assert units.max() <= 1.001, f"a moment {units.max().item():.3f} bf16 units from the exact one"


def test_the_moments_are_right_on_average_and_the_noise_follows_the_seed(module):
    tensors = _inputs(n=1024)
    _, m_ref, v_ref = _reference(*tensors, step=3)
    draws = [_step(module, tensors, seed=seed) for seed in range(120)]
    m_mean = torch.stack([d[2].cpu().double() for d in draws]).mean(0)
    v_mean = torch.stack([d[3].cpu().double() for d in draws]).mean(0)
    # 120 draws of a two-valued rounding: the mean is within 0.5 unit / √120 · 5 ≈ 0.23 unit at worst.
    m_units = (m_mean - m_ref) / _bf16_unit(m_ref.float()).double()
    v_units = (v_mean - v_ref) / _bf16_unit(v_ref.float()).double()
    assert m_units.abs().max() <= 0.25 and v_units.abs().max() <= 0.25, (m_units.abs().max(), v_units.abs().max())
    assert abs(m_units.mean()) < 0.02 and abs(v_units.mean()) < 0.02  # no bias overall
    same, other = _step(module, tensors, seed=5), _step(module, tensors, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(same, other))
    assert not torch.equal(_step(module, tensors, seed=6)[2], same[2])


def test_nan_moments_stay_nan(module):
    weight, low, grad, m, v = _inputs(n=64)
    grad[5] = float("nan")
    out = _step(module, (weight, low, grad, m, v))
    assert torch.isnan(out[2][5].float()) and torch.isnan(out[3][5].float())
    assert not torch.isnan(out[2][:5].float()).any()


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU: the optimizer uses the kernel on GPU tensors only")
def test_on_the_gpu_the_optimizer_steps_with_the_kernel_as_the_chunked_step_does():
    torch.manual_seed(0)
    shapes = [(512, 64), (64,), (300, 7)]
    base = [torch.randn(s).to(torch.bfloat16) for s in shapes]

    def make(kernel: bool):
        params = [torch.nn.Parameter(b.clone().cuda()) for b in base]
        optimizer = MasterWeightAdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1,
                                      state_dtype=torch.bfloat16, seed=3)
        assert optimizer.fused_kernel
        optimizer.fused_kernel = kernel
        return params, optimizer

    def run(params, optimizer, steps):
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=generator) * (1.0 if step < 20 else 0.01)).to(
                    torch.bfloat16).cuda()
            optimizer.clip_grad_norm(1.0)
            optimizer.step()
            optimizer.zero_grad()

    kernel_params, kernel = make(True)
    torch_params, chunked = make(False)
    run(kernel_params, kernel, range(1))
    run(torch_params, chunked, range(1))
    for a, b in zip(kernel.master_weights(), chunked.master_weights()):
        error = ((a - b).abs() - 1e-6 * b.abs()).max().item()
        assert error <= 2e-9, f"masters differ by {error:.3g} beyond 1e-6 relative after one step of ~1e-3"
    run(kernel_params, kernel, range(1, 200))
    run(torch_params, chunked, range(1, 200))
    v = [torch.cat([o.state[m]["exp_avg_sq"].float().flatten() for m in o.masters]) for o in (kernel, chunked)]
    assert abs(v[0].mean() / v[1].mean() - 1) < 0.01
    # A resumed run continues bit for bit: the noise is keyed by the seed, the step and the tensor.
    saved = copy.deepcopy(kernel.state_dict())
    run(kernel_params, kernel, range(200, 210))
    resumed_params, resumed = make(True)
    resumed.load_state_dict(saved)  # the checkpoint's masters go into the fresh parameters
    run(resumed_params, resumed, range(200, 210))
    assert all(torch.equal(a, b) for a, b in zip(kernel_params, resumed_params))


# -- the optimizer's step count, on the kernel's path ---------------------------------------------------------
# The kernel takes AdamW's bias corrections from the optimizer's host-side count (`steps`), not from the
# state's tensor that torch's step reads; on CPU the optimizer is made to take that path, the kernel run in
# Triton's interpreter. β2 = 0.999 makes the correction large for many steps: at step 8 it scales the update
# by √(1 − 0.999⁸) / (1 − 0.9⁸) ≈ 0.16, at step 1 by 0.32, so a count stuck or restarted moves the weights
# by far more than the bf16 moments' rounding (well under 1% of an update).
OPTIMIZER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
SHAPES = [(48, 32), (40,), (33, 7)]


def _kernel_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(torch.bfloat16).to(DEVICE)) for s in SHAPES]


def _on_the_kernel(module, monkeypatch, params, seed: int = 3, **options) -> MasterWeightAdamW:
    monkeypatch.setattr(precision, "adamw_bf16_step", module.adamw_bf16_step)  # interpreted on CPU
    optimizer = MasterWeightAdamW(params, state_dtype=torch.bfloat16, seed=seed, **OPTIMIZER, **options)
    optimizer.fused_kernel = True  # what a GPU gets by itself
    return optimizer


def _gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    scale = 1.0 if step % 3 else 4.0  # uneven, so m and v are not one gradient's multiples
    return [(torch.randn(s, generator=generator) * scale).to(torch.bfloat16) for s in SHAPES]


def _kernel_steps(optimizer: MasterWeightAdamW, params, steps: range) -> None:
    for step in steps:
        for p, g in zip(params, _gradients(step)):
            p.grad = g.to(DEVICE)
        optimizer.step()
        optimizer.zero_grad()


def _adamw_float64(starts: list[torch.Tensor], steps: range) -> list[torch.Tensor]:
    """AdamW from the definition, in float64, with the step count t = 1, 2, ... in both corrections."""
    beta1, beta2 = OPTIMIZER["betas"]
    lr, eps, decay = OPTIMIZER["lr"], OPTIMIZER["eps"], OPTIMIZER["weight_decay"]
    masters = [s.cpu().double() for s in starts]
    m = [torch.zeros_like(x) for x in masters]
    v = [torch.zeros_like(x) for x in masters]
    for t, step in enumerate(steps, start=1):
        for i, g in enumerate(_gradients(step)):
            g = g.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            masters[i] = masters[i] * (1 - lr * decay)
            m_hat, v_hat = m[i] / (1 - beta1 ** t), v[i] / (1 - beta2 ** t)
            masters[i] = masters[i] - lr * m_hat / (v_hat.sqrt() + eps)
    return masters


def test_the_kernel_path_counts_its_steps_for_the_bias_corrections(module, monkeypatch):
    params = _kernel_params()
    starts = [p.detach().float().cpu() for p in params]
    optimizer = _on_the_kernel(module, monkeypatch, params)
    _kernel_steps(optimizer, params, range(8))
    assert optimizer.steps == [8] * len(SHAPES)
    assert [float(optimizer.state[m]["step"]) for m in optimizer.masters] == [8.0] * len(SHAPES)
    got = torch.cat([w.cpu().double().flatten() for w in optimizer.master_weights()])
    want = torch.cat([w.flatten() for w in _adamw_float64(starts, range(8))])
    moved = (want - torch.cat([s.double().flatten() for s in starts])).norm()
    assert (got - want).norm() < 0.01 * moved, f"{(got - want).norm() / moved:.4f} of the movement off AdamW's"


def test_the_kernel_steps_state_in_host_memory_slice_by_slice_to_the_same_bits(module, monkeypatch):
    """offload_optimizer: each tensor's state staged piece by piece (slices of 500 elements here: the 48 × 32 tensor
    in four, the 33 × 7 one in one), the kernel told where each slice starts, gives the bits of whole tensors on
    the device, and each tensor's step is counted once."""
    kept_params, moved_params = _kernel_params(), _kernel_params()
    kept = _on_the_kernel(module, monkeypatch, kept_params)
    moved = _on_the_kernel(module, monkeypatch, moved_params, offload=True, piece_elements=500)
    _kernel_steps(kept, kept_params, range(5))
    _kernel_steps(moved, moved_params, range(5))
    assert moved.steps == kept.steps == [5] * len(SHAPES)
    for a, b in zip(kept.master_weights(), moved.master_weights()):
        assert torch.equal(a, b)
    for m, n in zip(kept.masters, moved.masters):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(kept.state[m][name].cpu(), moved.state[n][name].cpu())
    # a slice stepped with the noise of its own first element instead of its place would differ
    wrong_params = _kernel_params()
    wrong = _on_the_kernel(module, monkeypatch, wrong_params, offload=True, piece_elements=500)
    step = module.adamw_bf16_step
    monkeypatch.setattr(precision, "adamw_bf16_step", lambda *a, start=0, **k: step(*a, start=0, **k))
    _kernel_steps(wrong, wrong_params, range(5))
    assert not all(torch.equal(kept.state[m]["exp_avg_sq"].cpu(), wrong.state[n]["exp_avg_sq"].cpu())
                   for m, n in zip(kept.masters, wrong.masters))


def test_the_kernel_paths_step_count_survives_a_checkpoint(module, monkeypatch):
    """Four steps, a checkpoint through torch.save, four more in a fresh optimizer: the same bits as eight
    uninterrupted steps. A count restarted on resume would correct steps 5-8 as steps 1-4."""
    straight_params = _kernel_params()
    straight = _on_the_kernel(module, monkeypatch, straight_params)
    _kernel_steps(straight, straight_params, range(8))

    first = _kernel_params()
    interrupted = _on_the_kernel(module, monkeypatch, first)
    _kernel_steps(interrupted, first, range(4))
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = _kernel_params(seed=99)  # the checkpoint's masters must win over these values
    resumed = _on_the_kernel(module, monkeypatch, resumed_params, seed=0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert resumed.steps == [4] * len(SHAPES)
    _kernel_steps(resumed, resumed_params, range(4, 8))
    assert resumed.steps == straight.steps == [8] * len(SHAPES)
    for a, b in zip(straight.master_weights(), resumed.master_weights()):
        assert torch.equal(a, b)
    for m, n in zip(straight.masters, resumed.masters):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(straight.state[m][name], resumed.state[n][name])
