"""One decode step's attention, per layer: cohort's Triton flash-decoding kernel against SDPA.

The engine's decode step attends one query per sequence to that sequence's cached keys. Before the
Triton kernel (cohort/models/decode_attention.py) it called SDPA (cuDNN's fused attention on H100/H200)
with the query heads of each kv head folded into the query axis and an additive position mask over
the cache up to the step's KV-length bucket. This times both on the same cache, for the Qwen2.5-0.5B
(14 heads, 2 kv heads, head dim 64) and 1.5B (12 / 2 / 128) attention shapes. It prints µs per call
(GPU time: the calls are replayed from a CUDA graph, as in the engine), the rows' visible keys and
values read per second (GB/s), and the largest difference between the two outputs.

    python bench/decode_attention.py            # on a GPU
    python bench/decode_attention.py --sweep --rows 256 --lengths 256,512   # launch-config search
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohort.models import kernels  # noqa: E402
from cohort.models.decode_attention import decode_attention, default_launch  # noqa: E402
from cohort.models.modeling import grouped_query_attention  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


def time_us(fn, calls: int = 50, replays: int = 10) -> float:
    """GPU µs per call: `calls` calls captured in one CUDA graph (as the engine runs them), so
    the host's launch cost, which exceeds a small kernel's run time, is not what is measured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (calls * replays)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="64,256,1024")
    parser.add_argument("--lengths", default="256,640", help="each row's position + 1 (all rows alike)")
    parser.add_argument("--splits", default="", help="extra forced split counts to time, e.g. 1,2,4")
    parser.add_argument("--sweep", action="store_true",
                        help="time every (keys per block, warps, stages, splits) launch and print the fastest")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.sweep:
        return sweep(args)
    results = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            for length in (int(n) for n in args.lengths.split(",")):
                cache_len = -(-length // 128) * 128  # the engine's KV-length bucket
                cache_k = torch.randn(rows, kv_heads, cache_len, dim, device="cuda", dtype=torch.bfloat16)
                cache_v = torch.randn_like(cache_k)
                q = torch.randn(rows, 1, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                positions = torch.full((rows, 1), length - 1, device="cuda", dtype=torch.long)
                bias = kernels.cache_attention_bias_plain(positions, cache_len, None, torch.bfloat16)

                def sdpa():
                    return grouped_query_attention(q, cache_k, cache_v, bias)

                def triton_kernel(splits=None):
                    return decode_attention(q, cache_k, cache_v, positions, cache_len, num_splits=splits)

                error = (sdpa().float() - triton_kernel().float()).abs().max().item()
                bytes_read = 2 * rows * kv_heads * length * dim * 2
                visible_k, visible_v = cache_k[:, :, :length], cache_v[:, :, :length]

                def read_only():  # the same bytes read by a plain reduction: the achievable rate at this size
                    return visible_k.sum(dtype=torch.float32) + visible_v.sum(dtype=torch.float32)

                row = dict(shape=shape, rows=rows, keys=length, sdpa_us=time_us(sdpa),
                           triton_us=time_us(triton_kernel), read_only_us=time_us(read_only), max_abs_diff=error)
                for splits in (int(s) for s in args.splits.split(",") if s.strip()):
                    row[f"triton_{splits}_splits_us"] = time_us(lambda: triton_kernel(splits))
                row["sdpa_gb_s"] = bytes_read / row["sdpa_us"] / 1e3
                row["triton_gb_s"] = bytes_read / row["triton_us"] / 1e3
                row["read_only_gb_s"] = bytes_read / row["read_only_us"] / 1e3
                row["speedup"] = row["sdpa_us"] / row["triton_us"]
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                results.append(row)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_attention.json").write_text(json.dumps(results, indent=1))


def sweep(args) -> None:
    """The Triton kernel's launch configurations on each shape: the five fastest and the default."""
    results = []
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            for length in (int(n) for n in args.lengths.split(",")):
                cache_len = -(-length // 128) * 128
                cache_k = torch.randn(rows, kv_heads, cache_len, dim, device="cuda", dtype=torch.bfloat16)
                cache_v = torch.randn_like(cache_k)
                q = torch.randn(rows, 1, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                positions = torch.full((rows, 1), length - 1, device="cuda", dtype=torch.long)
                default = decode_attention(q, cache_k, cache_v, positions, cache_len).float()
                timings = []
                for block_n in (32, 64, 128):
                    for warps in (2, 4, 8):
                        for stages in (2, 3, 4):
                            for splits in (None, 1, 2, 4, 8):
                                launch = (block_n, warps, stages)

                                def call(launch=launch, splits=splits):
                                    return decode_attention(q, cache_k, cache_v, positions, cache_len,
                                                            num_splits=splits, launch=launch)
                                try:
                                    error = (call().float() - default).abs().max().item()
                                    timings.append(dict(block_n=block_n, warps=warps, stages=stages,
                                                        splits=splits, us=time_us(call, calls=20, replays=5),
                                                        max_abs_diff=error))
                                except Exception as exc:  # a launch that does not fit (registers, shared memory)
                                    print(f"  {shape} {launch} splits={splits}: {type(exc).__name__}", flush=True)
                timings.sort(key=lambda t: t["us"])
                block_n, warps, stages = default_launch(dim)
                default_us = next(t["us"] for t in timings if (t["block_n"], t["warps"], t["stages"], t["splits"])
                                  == (block_n, warps, stages, None))
                entry = dict(shape=shape, rows=rows, keys=length, default_us=default_us, fastest=timings[:5])
                print(json.dumps(entry), flush=True)
                results.append(entry)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "decode_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
