"""AdamW's moments in bf16: stochastic rounding is unbiased and picks a neighbour, a decaying second
moment follows the fp32 one where rounding to nearest would stall, any chunking steps the same bits,
and a resumed run continues bit for bit."""

import copy
import io

import pytest
import torch

from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.optim.bf16 import round_stochastic
from cohort_grpo.optim.precision import MasterWeightAdamW
from cohort_grpo.optim.optimizer import make_optimizer, optimizer_line

SHAPES = [(64, 32), (32,), (128, 16), (7,)]


def _bf16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above each fp32 value in magnitude, by integer arithmetic
    on the bit patterns: drop the low half (toward zero), or drop it and add one unit."""
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    down = (bits >> 16).to(torch.int32).to(torch.int16)
    up = ((bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int64)).to(torch.int32).to(torch.int16)
    return down.view(torch.bfloat16), up.view(torch.bfloat16)


def _round(values: torch.Tensor, seed: int) -> torch.Tensor:
    n = values.numel()
    out = torch.empty(values.shape, dtype=torch.bfloat16)
    round_stochastic(values.clone(), out, torch.Generator().manual_seed(seed), torch.empty(n, dtype=torch.int16),
                     torch.empty(n, dtype=torch.bool))
    return out


def test_stochastic_rounding_picks_a_neighbour_with_the_probability_that_keeps_the_mean():
    torch.manual_seed(0)
    values = torch.randn(4000) * torch.exp(torch.randn(4000) * 4)
    down, up = _bf16_neighbours(values)
    draws = torch.stack([_round(values, seed) for seed in range(400)])
    assert torch.all((draws == down) | (draws == up))  # never anything else
    # The chance of rounding away from zero is the value's fraction of the way between its neighbours.
    gap = up.float() - down.float()
    fraction = torch.where(gap != 0, (values - down.float()) / gap.where(gap != 0, torch.ones_like(gap)), 0.0)
    observed = (draws == up).float().mean(0).where(gap != 0, torch.zeros_like(gap))
    assert (observed - fraction).abs().max() < 0.1  # 400 draws: 5 standard deviations at p = 1/2
    assert abs((observed - fraction).mean()) < 0.005  # and no bias over 4,000 values
    assert not torch.equal(draws[0], draws[1])  # the seeds draw differently


def test_stochastic_rounding_keeps_nan_infinities_zeros_and_values_bf16_holds_exactly():
    nan = torch.tensor([0x7FFFFFFF, 0x7FC00000, -1], dtype=torch.int32).view(torch.float32)  # -1: 0xFFFFFFFF
    exact = torch.tensor([1.0, -2.5, 0.0, -0.0, float("inf"), float("-inf"), 2.0 ** 127, 2.0 ** -130])
    for seed in range(20):
        assert torch.isnan(_round(nan, seed)).all()  # a NaN pattern plus noise would wrap to a number
        rounded = _round(exact, seed)
        assert torch.equal(rounded.float(), exact)
        assert torch.equal(rounded.float().signbit(), exact.signbit())


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16)) for shape in SHAPES]


def _grad(step: int, shape, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16)


def _run(optimizer: MasterWeightAdamW, params, steps: range, scale=lambda step: 1.0) -> None:
    for step in steps:
        for i, p in enumerate(params):
            p.grad = _grad(step * 10 + i, p.shape, scale(step))
        optimizer.step()
        optimizer.zero_grad()


def test_moments_are_stored_in_bf16_and_take_half_the_bytes():
    params = _params()
    wide = MasterWeightAdamW(params, lr=1e-3)
    narrow = MasterWeightAdamW(_params(), lr=1e-3, state_dtype=torch.bfloat16)
    sizes = [sum(s[k].numel() * s[k].element_size() for s in o.state.values() for k in ("exp_avg", "exp_avg_sq"))
             for o in (wide, narrow)]
    assert sizes[1] * 2 == sizes[0]
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in narrow.state.values())


def test_a_decaying_second_moment_follows_fp32_where_rounding_to_nearest_would_stall():
    """β2 = 0.999: large gradients for 50 steps, then gradients 100× smaller. v must fall by 0.1% a
    step, under half a bf16 unit: rounded to nearest it would not move at all."""
    betas, lr = (0.9, 0.999), 1e-3
    scale = lambda step: 1.0 if step < 50 else 0.01  # noqa: E731
    reference = _params()
    fp32 = MasterWeightAdamW(reference, lr=lr, betas=betas)
    _run(fp32, reference, range(50), scale)
    peak = torch.cat([fp32.state[m]["exp_avg_sq"].flatten() for m in fp32.masters]).mean()
    _run(fp32, reference, range(50, 400), scale)
    params = _params()
    bf16 = MasterWeightAdamW(params, lr=lr, betas=betas, state_dtype=torch.bfloat16)
    _run(bf16, params, range(400), scale)
    v32 = torch.cat([fp32.state[m]["exp_avg_sq"].flatten() for m in fp32.masters])
    v16 = torch.cat([bf16.state[m]["exp_avg_sq"].float().flatten() for m in bf16.masters])
    assert v32.mean() < 0.75 * peak  # 0.999^350 ≈ 0.70: v really decays
    assert abs(v16.mean() / v32.mean() - 1) < 0.01  # and the bf16 moments follow it
    # The weights moved as fp32's did, within a small fraction of the total movement.
    start = torch.cat([p.detach().float().flatten() for p in _params()])
    w32 = torch.cat([fp32.master_weight(i).flatten() for i in range(len(params))])
    w16 = torch.cat([bf16.master_weight(i).flatten() for i in range(len(params))])
    assert (w16 - w32).norm() < 0.02 * (w32 - start).norm()


def test_any_chunking_steps_bf16_moments_to_the_same_bits():
    results = []
    for chunk_bytes in (1 << 30, 4 * 100):
        params = _params()
        optimizer = MasterWeightAdamW(params, lr=1e-2, state_dtype=torch.bfloat16, chunk_bytes=chunk_bytes, seed=3)
        _run(optimizer, params, range(5))
        results.append([t.clone() for m in optimizer.masters for t in optimizer.state[m].values()]
                       + [p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_resumed_run_continues_bit_for_bit():
    params = _params()
    straight = MasterWeightAdamW(params, lr=1e-2, state_dtype=torch.bfloat16, seed=7)
    _run(straight, params, range(6))

    first = _params()
    interrupted = MasterWeightAdamW(first, lr=1e-2, state_dtype=torch.bfloat16, seed=7)
    _run(interrupted, first, range(3))
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = _params(seed=99)  # the checkpoint's masters, not these values, must win
    resumed = MasterWeightAdamW(resumed_params, lr=1e-2, state_dtype=torch.bfloat16, seed=0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert all(s["exp_avg_sq"].dtype == torch.bfloat16 for s in resumed.state.values())
    _run(resumed, resumed_params, range(3, 6))
    for a, b in zip(params, resumed_params):
        assert torch.equal(a, b)
    for m, n in zip(straight.masters, resumed.masters):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(straight.state[m][name], resumed.state[n][name])


def test_a_checkpoint_with_fp32_moments_loads_into_bf16_moments_and_back():
    params = _params()
    wide = MasterWeightAdamW(params, lr=1e-2)
    _run(wide, params, range(2))
    narrow = MasterWeightAdamW(_params(), lr=1e-2, state_dtype=torch.bfloat16)
    narrow.load_state_dict(wide.state_dict())
    for m, n in zip(wide.masters, narrow.masters):
        assert torch.equal(narrow.state[n]["exp_avg"], wide.state[m]["exp_avg"].to(torch.bfloat16))
    again = MasterWeightAdamW(_params(), lr=1e-2)
    again.load_state_dict(narrow.state_dict())
    assert all(s["exp_avg"].dtype == torch.float32 for s in again.state.values())


def test_make_optimizer_keeps_bf16_moments_by_default_for_bf16_weights_only():
    bf16_model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert make_optimizer(bf16_model, GRPOConfig()).state_dtype == torch.bfloat16
    assert make_optimizer(bf16_model, GRPOConfig(optimizer_state_dtype="float32")).state_dtype == torch.float32
    fp32_model = torch.nn.Linear(4, 4)
    assert type(make_optimizer(fp32_model, GRPOConfig())) is torch.optim.AdamW
    with pytest.raises(CohortError, match="optimizer_state_dtype=bfloat16 needs low-precision weights"):
        make_optimizer(fp32_model, GRPOConfig(optimizer_state_dtype="bfloat16"))
    # On a CPU the bf16 moments step in torch chunks (the kernel is for GPU tensors).
    assert optimizer_line(make_optimizer(bf16_model, GRPOConfig())) == (
        "optimizer: AdamW, fp32 masters, bf16 moments (stochastic rounding), chunked torch step")
    assert optimizer_line(make_optimizer(bf16_model, GRPOConfig(optimizer_state_dtype="float32"))).endswith(
        "fp32 moments, chunked torch step")
    assert optimizer_line(make_optimizer(fp32_model, GRPOConfig())) == "optimizer: AdamW over the weights in their own dtype"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fused AdamW kernel and the CUDA generator")
def test_on_the_gpu_bf16_moments_follow_fp32_and_resume_and_chunk_to_the_same_bits():
    def params():
        return [torch.nn.Parameter(p.detach().cuda()) for p in _params()]

    def run(optimizer, tensors, steps):
        for step in steps:
            for i, p in enumerate(tensors):
                p.grad = _grad(step * 10 + i, p.shape, 1.0 if step < 20 else 0.01).cuda()
            optimizer.step()
            optimizer.zero_grad()

    def moments(optimizer):
        return torch.cat([optimizer.state[m]["exp_avg_sq"].float().flatten() for m in optimizer.masters])

    betas = (0.9, 0.999)
    wide_params = params()
    wide = MasterWeightAdamW(wide_params, lr=1e-3, betas=betas)
    run(wide, wide_params, range(200))
    runs = []
    for chunk_bytes in (1 << 30, 4 * 100):
        tensors = params()
        narrow = MasterWeightAdamW(tensors, lr=1e-3, betas=betas, state_dtype=torch.bfloat16, chunk_bytes=chunk_bytes)
        assert narrow.defaults["fused"]
        run(narrow, tensors, range(100))
        saved = copy.deepcopy(narrow.state_dict())  # its tensors are the live state
        run(narrow, tensors, range(100, 200))
        runs.append((narrow, tensors, saved))
    (first, first_params, saved), (second, second_params, _) = runs
    assert abs(moments(first).mean() / moments(wide).mean() - 1) < 0.01
    assert all(torch.equal(a, b) for a, b in zip(first_params, second_params))  # chunking changes no bit
    assert torch.equal(moments(first), moments(second))
    resumed_params = params()
    resumed = MasterWeightAdamW(resumed_params, lr=1e-3, betas=betas, state_dtype=torch.bfloat16)
    resumed.load_state_dict(saved)
    run(resumed, resumed_params, range(100, 200))
    assert all(torch.equal(a, b) for a, b in zip(first_params, resumed_params))
