"""Which tiles may the exact (batch-invariant) matmul use, and what does each cost? A GPU probe for
rollout_numerics=exact (cohort_grpo/kernels/exact_matmul.py, exact_attention.py).

The exact matmul sums each output's reduction axis K in BLOCK_K steps from zero within chunks of CHUNK_K,
then adds the chunks in order. Whether the bits then depend on the tile's other sizes (BLOCK_M, BLOCK_N,
warps, stages, and so the tensor-core instruction Triton picks) is a property of the hardware and the
compiler, not of the code: this measures it. For every projection of the named Qwen2.5 shapes (random bf16
weights) and every candidate tile it reports:

- bits: whether the candidate's output equals the default tile's, bit for bit, on 4,096 rows and on the first
  1, 17, 64 and 256 rows alone, whole and split by chunk (one program per chunk, then the chunks added);
- speed: GPU µs per call replayed from a CUDA graph at decode widths (64, 256 rows) and training widths
  (4,096 and 16,384 rows), against cuBLAS (`F.linear`) in the same process.

Then the decode-step attention: the exact kernel with one query per program, the same kernel with a kv head's
query heads packed into one tile (bits compared), and the fast path's flash-decoding, at the shape's
decode batch.

    python bench/exact_tiles.py --models 0.5b,1.5b          # GPU; JSON to $OUT/exact_tiles.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cohort from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step_worker import SHAPES, layer_projections  # noqa: E402

from cohort_grpo.kernels import exact_attention, exact_matmul  # noqa: E402
from cohort_grpo.kernels.exact_matmul import Tile  # noqa: E402

CANDIDATES = [
    Tile(64, 64, 64, 4, 3),  # the default (TILE)
    Tile(16, 64, 64, 4, 4), Tile(32, 64, 64, 4, 4), Tile(64, 32, 64, 4, 4), Tile(64, 64, 64, 4, 4),
    Tile(64, 128, 64, 4, 4), Tile(64, 256, 64, 8, 3), Tile(64, 64, 128, 4, 3), Tile(64, 128, 32, 4, 5),
    Tile(128, 64, 64, 4, 4), Tile(128, 128, 64, 8, 3), Tile(128, 128, 64, 8, 4), Tile(128, 128, 64, 4, 4),
    Tile(128, 256, 64, 8, 3), Tile(256, 128, 64, 8, 3), Tile(128, 128, 128, 8, 3), Tile(128, 128, 32, 8, 5),
]
BITS_ROWS = (1, 17, 64, 256)
DECODE_ROWS = (64, 256)
TRAIN_ROWS = (4096, 16384)


def projections(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each product a decoder layer and the LM head compute."""
    return {**layer_projections(shape), "lm_head": (shape["vocab_size"], shape["hidden_size"])}


def graph_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=25)


def tile_name(tile: Tile) -> str:
    return f"{tile.block_m}x{tile.block_n}x{tile.block_k}/w{tile.num_warps}/s{tile.num_stages}"


def bits(x: torch.Tensor, weight: torch.Tensor, reference: torch.Tensor, tile: Tile) -> str:
    try:
        for split in (False, True):
            if not torch.equal(exact_matmul.matmul(x, weight, tile=tile, split=split), reference):
                return f"differs{' (split)' if split else ''}"
            for rows in BITS_ROWS:
                if not torch.equal(exact_matmul.matmul(x[:rows], weight, tile=tile, split=split), reference[:rows]):
                    return f"differs at {rows} rows{' (split)' if split else ''}"
        return "equal"
    except Exception as error:  # a tile that does not compile (shared memory) is a finding, not a crash
        return f"error: {type(error).__name__}: {str(error)[:80]}"


def probe_matmuls(model: str, device: torch.device) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, (n, k) in projections(SHAPES[model]).items():
        weight = (torch.randn(n, k, generator=generator, device=device) / k ** 0.5).bfloat16()
        x = torch.randn(max(TRAIN_ROWS), k, generator=generator, device=device).bfloat16()
        reference = exact_matmul.matmul(x[:4096], weight, tile=exact_matmul.TILE, split=False)
        equal = {tile_name(t): bits(x[:4096], weight, reference, t) for t in CANDIDATES}
        for m in DECODE_ROWS + TRAIN_ROWS:
            if name == "lm_head" and m > 4096:
                continue
            xm = x[:m]
            row = dict(model=model, projection=name, n=n, k=k, rows=m,
                       cublas_us=round(graph_us(lambda: F.linear(xm, weight)), 2), tiles={})
            for tile in CANDIDATES:
                if not equal[tile_name(tile)].startswith("equal"):
                    continue
                timed = {"whole": round(graph_us(lambda: exact_matmul.matmul(xm, weight, tile=tile, split=False)), 2)}
                if k > exact_matmul.CHUNK_K and m <= 1024:
                    timed["split"] = round(graph_us(lambda: exact_matmul.matmul(xm, weight, tile=tile, split=True)), 2)
                row["tiles"][tile_name(tile)] = timed
            best = min(((t, mode, us) for t, modes in row["tiles"].items() for mode, us in modes.items()),
                       key=lambda item: item[2])
            row["best"] = dict(tile=best[0], mode=best[1], us=best[2], vs_cublas=round(best[2] / row["cublas_us"], 2))
            row["default_us"] = row["tiles"][tile_name(exact_matmul.TILE)]["whole"]
            rows.append(row)
            print(f"{model} {name:8s} M={m:6d} N={n:6d} K={k:5d}: cuBLAS {row['cublas_us']:9.1f} µs, default tile "
                  f"{row['default_us']:9.1f}, best {best[0]} {best[1]} {best[2]:9.1f} ({row['best']['vs_cublas']}× cuBLAS)",
                  flush=True)
        rows.append(dict(model=model, projection=name, bits=equal))
        print(f"{model} {name}: bits against the default tile: " +
              ", ".join(f"{t} {v}" for t, v in equal.items()), flush=True)
    return rows


def probe_attention(model: str, device: torch.device, batch: int, cache_len: int) -> dict:
    from cohort_grpo.kernels.decode_attention import decode_attention

    shape = SHAPES[model]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape.get("head_dim") or shape["hidden_size"] // heads
    generator = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(batch, heads, 1, dim, generator=generator, device=device).bfloat16()
    cache_k = torch.randn(batch, kv_heads, cache_len, dim, generator=generator, device=device).bfloat16()
    cache_v = torch.randn(batch, kv_heads, cache_len, dim, generator=generator, device=device).bfloat16()
    positions = torch.randint(cache_len // 5, cache_len, (batch, 1), generator=generator, device=device)
    one_per_program = exact_attention.attention_forward(q, cache_k, cache_v, positions, packed_heads=False)
    packed = exact_attention.attention_forward(q, cache_k, cache_v, positions)
    result = dict(model=model, batch=batch, cache_len=cache_len,
                  packed_equals_one_per_program=bool(torch.equal(packed, one_per_program)),
                  exact_one_per_program_us=round(graph_us(lambda: exact_attention.attention_forward(
                      q, cache_k, cache_v, positions, packed_heads=False)), 2),
                  exact_packed_us=round(graph_us(lambda: exact_attention.attention_forward(q, cache_k, cache_v,
                                                                                         positions)), 2),
                  fast_flash_decoding_us=round(graph_us(lambda: decode_attention(q, cache_k, cache_v, positions,
                                                                                 cache_len)), 2))
    # A training row's queries through the general kernel give the decode step's bits at each position
    length = 640
    rows_q = torch.randn(2, heads, length, dim, generator=generator, device=device).bfloat16()
    rows_k = torch.randn(2, kv_heads, length, dim, generator=generator, device=device).bfloat16()
    rows_v = torch.randn(2, kv_heads, length, dim, generator=generator, device=device).bfloat16()
    limits = torch.arange(length, device=device).expand(2, length)
    full = exact_attention.attention_forward(rows_q, rows_k, rows_v, limits)
    agree = all(torch.equal(exact_attention.attention_forward(rows_q[:, :, t:t + 1].contiguous(), rows_k, rows_v,
                                                              limits[:, t:t + 1]), full[:, :, t:t + 1])
                for t in (0, 1, 63, 64, 300, 639))
    result["decode_equals_full_forward"] = agree
    result["full_forward_us"] = round(graph_us(lambda: exact_attention.attention_forward(rows_q, rows_k, rows_v,
                                                                                        limits)), 2)
    result["sdpa_causal_us"] = round(graph_us(lambda: F.scaled_dot_product_attention(
        rows_q, rows_k.repeat_interleave(heads // kv_heads, 1), rows_v.repeat_interleave(heads // kv_heads, 1),
        is_causal=True)), 2)
    print(f"{model} attention: {json.dumps(result)}", flush=True)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--decode-batch", type=int, default=256)
    parser.add_argument("--cache-len", type=int, default=640)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    report = dict(card=torch.cuda.get_device_name(device), torch=torch.__version__,
                  triton=__import__("triton").__version__, chunk_k=exact_matmul.CHUNK_K,
                  default_tile=tile_name(exact_matmul.TILE), date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                  matmuls=[], attention=[])
    for model in args.models.split(","):
        report["attention"].append(probe_attention(model, device, args.decode_batch, args.cache_len))
        report["matmuls"] += probe_matmuls(model, device)
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "exact_tiles.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
