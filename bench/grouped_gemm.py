"""A decode step's grouped expert products: torch's native grouped GEMM against cohort's thin Triton kernel.

At a decode step a mixture of experts sends each of N sequences' tokens to k experts: N·k rows over E experts,
a few rows an expert (64 sequences, top-8 of 128: 4 on average), while nearly every expert's weights are read.
The product is then bound by reading the weights, and this times, per MoE shape of bench/grpo_step_worker.py,
its two projections (gate and up side by side [E, 2I, H]; down [E, H, I]), whole (T = 1) or split by columns
over T GPUs (the tensor-parallel engine's shard: 2I/T output columns, I/T input columns of down):

- `native`: `F.grouped_mm` (CUTLASS), what training and prefill use;
- `thin`: `cohort_grpo.kernels.thin_grouped_mm` at its default tile, and with `--sweep` at each tile of SWEEP;
- the bandwidth each uses: bytes read and written (the weights of the experts with rows, the rows in and out)
  ÷ its time, against the device-to-device copy rate measured in the same run (an H200's HBM3e is rated
  4.8 TB/s).

GPU µs per call, calls replayed from a CUDA graph as in the engine; routing uniform at random (as a random-weight
model's router gives; a trained router's skew leaves more experts without rows, which both read less for).
Each result is checked against the native product (max |Δ| relative to the output's largest value).

    python bench/grouped_gemm.py --shapes qwen3-30b-a3b-half --sequences 64,128,256,512 --tp 1,2 --sweep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_attention import time_us  # noqa: E402
from bench.decode_gemm import copy_rate_gbs  # noqa: E402
from bench.grpo_step_worker import SHAPES  # noqa: E402
from cohort_grpo.kernels.grouped_mm import native_grouped_linear  # noqa: E402
from cohort_grpo.kernels.thin_grouped_mm import SMALL_TILE, ThinTile, thin_grouped_linear  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

# (block_m, tile); block_m None: the kernel's rule (rows_per_tile). Measured on an H200 (2026-11-29): TILE
# (128, 64, 8, 4) within 4% of the fastest at 64-128 sequences and the fastest at 256-1,024.
SWEEP = [(None, ThinTile(64, 128, 4, 4)), (None, ThinTile(128, 128, 4, 4)), (None, ThinTile(64, 256, 4, 3)),
         (None, ThinTile(128, 64, 8, 4)), (None, ThinTile(32, 256, 4, 3)), (None, ThinTile(128, 128, 8, 4)),
         (16, ThinTile(128, 128, 4, 4)), (32, ThinTile(128, 128, 4, 4)), (64, ThinTile(128, 128, 4, 4)),
         (128, ThinTile(128, 128, 8, 4)), (64, ThinTile(64, 128, 4, 4)), (None, SMALL_TILE)]


def routed_rows(tokens: int, experts: int, top_k: int, hidden: int, generator: torch.Generator):
    """x [tokens·k, hidden] sorted by expert and its offsets [E], each token's k distinct experts at random."""
    ids = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(tokens * top_k, hidden, generator=generator).to(torch.bfloat16)
    return x.cuda(), counts.cumsum(0).to(torch.int32).cuda(), int((counts > 0).sum())


def measure(weight: torch.Tensor, sequences: int, top_k: int, sweep: bool, generator: torch.Generator) -> dict:
    """One product at `sequences` decode rows: both kernels' µs, the bytes they move, the thin one's error, and
    with `sweep` each tile of SWEEP's µs (a tile the card's shared memory cannot hold is left out)."""
    experts, n, k = weight.shape
    x, offsets, used = routed_rows(sequences, experts, top_k, k, generator)
    reference = native_grouped_linear(x, weight, offsets)
    thin = thin_grouped_linear(x, weight, offsets)
    tiles = {}
    for block_m, tile in SWEEP if sweep else []:
        try:
            tiles[f"{block_m}, {tuple(tile)}"] = round(time_us(
                lambda: thin_grouped_linear(x, weight, offsets, tile, block_m)), 1)
        except OutOfResources:
            continue
    return dict(sequences=sequences, rows=x.shape[0], experts_with_rows=used,
                native_us=round(time_us(lambda: native_grouped_linear(x, weight, offsets)), 1),
                thin_us=round(time_us(lambda: thin_grouped_linear(x, weight, offsets)), 1),
                bytes_moved=used * n * k * 2 + x.numel() * 2 + reference.numel() * 2,
                max_relative_error=((thin.float() - reference.float()).abs().max()
                                    / reference.float().abs().max()).item(), tiles=tiles)


def table_row(row: dict, experts: int) -> str:
    best = min(row["tiles"].items(), key=lambda kv: kv[1]) if row["tiles"] else None
    native, thin, moved = row["native_us"], row["thin_us"], row["bytes_moved"]
    return (f"| {row['shape']} | {row['tp']} | {row['projection']} | {row['sequences']} | {row['rows'] / experts:.1f} "
            f"| {native:.1f} | {thin:.1f} | {moved / native / 1e3:,.0f} / {moved / thin / 1e3:,.0f} "
            f"| {thin / native:.2f} "
            f"| {f'{best[0]} ({best[1]:.1f})' if best else '—'} | {row['max_relative_error']:.1e} |")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b-half,qwen3-moe-1b-7b")
    parser.add_argument("--sequences", default="64,128,256,512,1024")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes: each expert's columns split T ways")
    parser.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/grouped_gemm"))
    args = parser.parse_args(argv)
    rate = copy_rate_gbs()
    generator = torch.Generator().manual_seed(0)
    report = dict(card=torch.cuda.get_device_name(), copy_rate_gbs=round(rate, 1), rows=[])
    print(f"{report['card']}: copy rate {rate:,.0f} GB/s")
    print("| shape | T | projection | sequences | rows an expert | native µs | thin µs | native / thin GB/s "
          "| thin ÷ native | best tile (µs) | max rel Δ |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        experts, hidden, inner = shape["num_experts"], shape["hidden_size"], shape["moe_intermediate_size"]
        for tp in [int(t) for t in args.tp.split(",")]:
            for projection, (n, k) in {"gate_up": (2 * inner // tp, hidden), "down": (hidden, inner // tp)}.items():
                weight = (torch.randn(experts, n, k, generator=generator) * 0.02).to(torch.bfloat16).cuda()
                for sequences in [int(s) for s in args.sequences.split(",")]:
                    row = dict(shape=name, tp=tp, projection=projection,
                               **measure(weight, sequences, shape["num_experts_per_tok"], args.sweep, generator))
                    report["rows"].append(row)
                    print(table_row(row, experts), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grouped_gemm.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
