"""The decode step's grouped expert product (cohort_grpo.kernels.thin_grouped_mm) against a loop over experts.

Without CUDA the kernel runs in Triton's interpreter. The routings cover an expert without rows (its weights
unread, its output rows absent), an expert with more rows than one tile holds, and shapes that fill no tile
exactly (N and K not multiples of the blocks)."""

import pytest
import torch
from triton_interpreter import DEVICE, kernel_module

thin = kernel_module("cohort_grpo.kernels.thin_grouped_mm", "_thin_grouped_kernel")

pytest.importorskip("triton", reason="triton is not installed; the thin grouped kernel cannot run")


def expert_loop(x, weight, counts):
    """Each expert's rows times its matrix in float64, one expert at a time."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        outs.append(x[start: start + n].double() @ weight[e].double().T)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 40, 1], [1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thin_product_equals_expert_loop(counts, dtype):
    generator = torch.Generator().manual_seed(sum(counts) * 7 + len(counts))
    n, k = 150, 200  # two column blocks of TILE (the second partly empty); K blocks, the last partly empty
    x = torch.randn(sum(counts), k, generator=generator).to(dtype)
    weight = torch.randn(len(counts), n, k, generator=generator).to(dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = thin.thin_grouped_linear(x.to(DEVICE), weight.to(DEVICE), offsets.to(DEVICE)).cpu()
    assert out.shape == (sum(counts), n) and out.dtype == dtype
    expected = expert_loop(x, weight, counts)
    # float32: the sum's order alone; bfloat16: one rounding of values of magnitude up to ~50 (2^-8 relative)
    tolerance = 1e-3 if dtype == torch.float32 else 0.5
    assert torch.all((out.double() - expected).abs() <= tolerance)


def test_thin_product_takes_strided_views():
    """The engine hands the product a slice of a wider activation and a weight view; both reach the kernel."""
    generator = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 64, generator=generator)
    x = wide[:, :32]  # row stride 64, not 32
    weight = torch.randn(2, 16, 32, generator=generator)
    counts = [4, 2]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = thin.thin_grouped_linear(x.to(DEVICE), weight.to(DEVICE), offsets.to(DEVICE)).cpu()
    assert (out.double() - expert_loop(x, weight, counts)).abs().max() <= 1e-4


def test_a_tile_the_card_cannot_launch_gives_way_to_the_small_tile(monkeypatch):
    """A GPU with less shared memory than TILE needs: the launch raises before anything runs, SMALL_TILE serves
    (remembered for later calls), and the product is the same."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(9, 40, generator=generator)
    weight = torch.randn(3, 24, 40, generator=generator)
    counts = [2, 0, 7]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    launched = []
    real_launch = thin.launch

    def launch(x, weight, offsets, out, tile, block_m):
        launched.append(tile)
        if tile == thin.TILE:
            raise thin.OUT_OF_RESOURCES(262144, 232448, "shared memory")
        real_launch(x, weight, offsets, out, tile, block_m)

    monkeypatch.setattr(thin, "launch", launch)
    monkeypatch.setattr(thin, "UNFIT_TILES", set())
    out = thin.thin_grouped_linear(x.to(DEVICE), weight.to(DEVICE), offsets.to(DEVICE)).cpu()
    assert launched == [thin.TILE, thin.SMALL_TILE]
    assert torch.all((out.double() - expert_loop(x, weight, counts)).abs() <= 1e-4)
    thin.thin_grouped_linear(x.to(DEVICE), weight.to(DEVICE), offsets.to(DEVICE))
    assert launched[2:] == [thin.SMALL_TILE]  # TILE is not tried again


def test_every_tile_of_the_sweep_gives_the_product():
    """bench/grouped_gemm.py times other tiles and row blocks; each must compute the same product."""
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(20, 96, generator=generator)
    weight = torch.randn(2, 80, 96, generator=generator)
    counts = [17, 3]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    expected = expert_loop(x, weight, counts)
    for tile, block_m in [(thin.SMALL_TILE, 16), (thin.TILE, 32), (thin.ThinTile(32, 32, 4, 2), None)]:
        out = thin.thin_grouped_linear(x.to(DEVICE), weight.to(DEVICE), offsets.to(DEVICE), tile, block_m).cpu()
        assert torch.all((out.double() - expected).abs() <= 1e-4), (tile, block_m)


@pytest.mark.skipif(DEVICE != "cuda", reason="the sampling path takes Triton kernels on CUDA only")
def test_the_sampling_path_takes_the_thin_product_up_to_thin_rows(monkeypatch):
    """Under the engine's fused kernels and autograd off, `grouped_linear` is the thin kernel at up to
    THIN_ROWS_PER_EXPERT rows an expert and torch's grouped GEMM above; with autograd on (training) always the
    native product."""
    from cohort_grpo.kernels import grouped_mm
    from cohort_grpo.kernels.elementwise import fused_kernels

    taken = []
    monkeypatch.setattr(grouped_mm, "thin_grouped_linear",
                        lambda *args: taken.append(args[0].shape[0]) or thin.thin_grouped_linear(*args))
    generator = torch.Generator().manual_seed(13)
    weight = torch.randn(8, 64, 128, generator=generator).to(torch.bfloat16).cuda()
    most = grouped_mm.THIN_ROWS_PER_EXPERT * 8  # 8 experts
    for rows in (64, most, most + 8):
        x = torch.randn(rows, 128, generator=generator).to(torch.bfloat16).cuda()
        offsets = torch.linspace(rows / 8, rows, 8).round().to(torch.int32).cuda()
        with torch.inference_mode(), fused_kernels(True):
            sampled = grouped_mm.grouped_linear(x, weight, offsets)
        with fused_kernels(True):
            trained = grouped_mm.grouped_linear(x.requires_grad_(), weight, offsets)
        assert (sampled.float() - trained.float()).abs().max() <= 1e-2 * trained.float().abs().max()
    assert taken == [64, most]
