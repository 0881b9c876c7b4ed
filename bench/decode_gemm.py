"""The decode step's projections at few rows: cuBLAS as PyTorch calls it, against split-K.

At 256 rows a decode step's GEMMs are thin: the down projection of the Qwen2.5-1.5B shape
(256 × 8960 → 1536) has 2 × 12 output tiles of 128 × 128, so cuBLAS's kernel keeps ~24 of an H100's
132 SMs busy while the weight read alone would fill them all. Split-K cuts the reduction axis into
S slices computed as one batched GEMM (S× the tiles) with fp32 partial sums, then adds the slices:
the same fp32 accumulation cuBLAS does inside a tile, one bf16 rounding at the end.

This times, per projection of each model shape, GPU µs per call (calls replayed from a CUDA graph,
as in the engine) for `F.linear` and split-K at S = 2, 4, 8, next to the floor (weight + input +
output bytes ÷ the copy rate measured in the same run), and the largest error of each against an
fp32 product.

    python bench/decode_gemm.py --models 0.5b,1.5b,7b --rows 64,256

Result (H100, 2026-11-26, docs/history/benchmarks-2026-11.md): split-K was slower than `F.linear` for
every projection and size, and `F.linear` ran within 1.0-1.3x of the floor for the large ones, so the
engine keeps plain `F.linear`. `--autotune` (H100, 23:11 the same day) did no better: only the o
projection gained, 5.5 -> 5.3 µs; gate_up and down were 39% and 43% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_attention import time_us  # noqa: E402
from bench.grpo_step_worker import SHAPES, layer_projections  # noqa: E402


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """`F.linear(x, weight)` as `splits` slices of the input features: one batched GEMM into fp32
    partial sums (no copy of either operand), their sum, one rounding to bf16."""
    rows, features = x.shape
    step = features // splits
    x_slices = x.view(rows, splits, step).transpose(0, 1)  # [S, rows, step]
    w_slices = weight.view(weight.shape[0], splits, step).permute(1, 2, 0)  # [S, step, out]
    return torch.bmm(x_slices, w_slices, out_dtype=torch.float32).sum(0).to(x.dtype)

def copy_rate_gbs() -> float:
    """Device-to-device copy rate of a 1 GiB buffer (read + write bytes per second)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / time_us(lambda: dst.copy_(src), calls=10, replays=5) / 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--splits", default="2,4,8")
    parser.add_argument("--autotune", action="store_true",
                        help="also time torch.compile(F.linear, mode='max-autotune-no-cudagraphs'): Inductor "
                             "benchmarks its Triton GEMM templates against cuBLAS for each shape and keeps the fastest")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rate = copy_rate_gbs()
    print(f"{torch.cuda.get_device_name()}: copy rate {rate:.0f} GB/s")
    print("| model | projection | rows | out × in | F.linear µs | " + " | ".join(f"split {s} µs" for s in args.splits.split(","))
          + " | autotuned µs" * args.autotune + " | floor µs | best vs linear | max error linear / best |")
    results = []
    for model in args.models.split(","):
        for name, (out_features, in_features) in layer_projections(SHAPES[model]).items():
            weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / in_features**0.5
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
                exact = x.float() @ weight.float().T
                row = dict(model=model, projection=name, rows=rows, out=out_features, features=in_features,
                           linear_us=time_us(lambda: F.linear(x, weight)),
                           linear_error=(F.linear(x, weight).float() - exact).abs().max().item())
                if args.autotune:
                    tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                    row["autotuned_error"] = (tuned(x, weight).float() - exact).abs().max().item()  # tunes here
                    row["autotuned_us"] = time_us(lambda: tuned(x, weight))
                for splits in [int(s) for s in args.splits.split(",") if s]:
                    if in_features % splits:
                        continue
                    row[f"split{splits}_us"] = time_us(lambda: split_k_linear(x, weight, splits))
                    row[f"split{splits}_error"] = (split_k_linear(x, weight, splits).float() - exact).abs().max().item()
                nbytes = 2 * (weight.numel() + x.numel() + rows * out_features)
                row["floor_us"] = nbytes / rate / 1e3
                candidates = [k for k in row if k.startswith(("split", "autotuned")) and k.endswith("_us")]
                best = min(candidates, key=row.get) if candidates else None
                row["best"] = best
                results.append(row)
                cells = " | ".join(f"{row[k]:.1f}" if k in row else "—" for k in
                                   [f"split{s}_us" for s in args.splits.split(",") if s] + ["autotuned_us"] * args.autotune)
                print(f"| {model} | {name} | {rows} | {out_features} × {in_features} | {row['linear_us']:.1f} | {cells} | "
                      f"{row['floor_us']:.1f} | {row['linear_us'] / row[best]:.2f}× ({best}) | "
                      f"{row['linear_error']:.2g} / {row[best.replace('_us', '_error')]:.2g} |", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_gemm.json").write_text(json.dumps(dict(copy_rate_gbs=rate, rows=results), indent=1))


if __name__ == "__main__":
    main()
