"""One decode step's attention, per layer: cohort's Triton flash-decoding kernel against SDPA.

The engine's decode step attends one query per sequence to that sequence's cached keys. Before the
Triton kernel (cohort_grpo/kernels/decode_attention.py) it called SDPA (cuDNN's fused attention on H100/H200)
with the query heads of each kv head folded into the query axis and an additive position mask over
the cache up to the step's KV-length bucket. This times both on the same cache, for the Qwen2.5-0.5B
(14 heads, 2 kv heads, head dim 64) and 1.5B (12 / 2 / 128) attention shapes. It prints µs per call
(GPU time: the calls are replayed from a CUDA graph, as in the engine), the rows' visible keys and
values read per second (GB/s), and the largest difference between the two outputs.

    python bench/decode_attention.py            # on a GPU; also times rows reading a shared 128-key prompt
    python bench/decode_attention.py --sweep --rows 256 --lengths 256,512   # launch-config search
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cohort_grpo.kernels import elementwise as kernels# noqa: E402
from cohort_grpo.kernels.decode_attention import decode_attention, default_launch# noqa: E402
from cohort_grpo.models.decoder import grouped_query_attention  # noqa: E402

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
    parser.add_argument("--prefix", type=int, default=128,
                        help="also time rows reading a shared prompt of this many keys from their group's first row (0: off)")
    parser.add_argument("--generations", type=int, default=8, help="rows per shared prompt (with --prefix)")
    parser.add_argument("--sweep", action="store_true",
                        help="time every (keys per block, warps, stages, splits) launch and print the fastest")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = [(sweep if args.sweep else compare)(case, args) for case in cases(args)]
    if os.environ.get("OUT"):
        name = "decode_sweep.json" if args.sweep else "decode_attention.json"
        Path(os.environ["OUT"], name).write_text(json.dumps(results, indent=1))


@dataclass
class Case:
    """One decode step's attention inputs: every row at the same position, random bf16 values."""

    shape: str
    rows: int
    keys: int  # each row's position + 1
    kv_heads: int
    dim: int
    cache_len: int  # the engine's KV-length bucket
    q: torch.Tensor
    cache_k: torch.Tensor
    cache_v: torch.Tensor
    positions: torch.Tensor


def cases(args):
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            for length in (int(n) for n in args.lengths.split(",")):
                cache_len = -(-length // 128) * 128
                cache_k = torch.randn(rows, kv_heads, cache_len, dim, device="cuda", dtype=torch.bfloat16)
                q = torch.randn(rows, 1, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                positions = torch.full((rows, 1), length - 1, device="cuda", dtype=torch.long)
                yield Case(shape, rows, length, kv_heads, dim, cache_len, q, cache_k, torch.randn_like(cache_k),
                           positions)


def compare(case: Case, args) -> dict:
    """SDPA (the engine's path before the kernel), the kernel, and a plain read of the same bytes."""
    bias = kernels.cache_attention_bias_plain(case.positions, case.cache_len, None, torch.bfloat16)

    def sdpa():
        return grouped_query_attention(case.q, case.cache_k, case.cache_v, bias)

    def triton_kernel(splits=None):
        return decode_attention(case.q, case.cache_k, case.cache_v, case.positions, case.cache_len, num_splits=splits)

    visible_k, visible_v = case.cache_k[:, :, :case.keys], case.cache_v[:, :, :case.keys]

    def read_only():  # the same bytes read by a plain reduction: the achievable rate at this size
        return visible_k.sum(dtype=torch.float32) + visible_v.sum(dtype=torch.float32)

    error = (sdpa().float() - triton_kernel().float()).abs().max().item()
    row = dict(shape=case.shape, rows=case.rows, keys=case.keys, sdpa_us=time_us(sdpa),
               triton_us=time_us(triton_kernel), read_only_us=time_us(read_only), max_abs_diff=error)
    if args.prefix and args.prefix < case.keys:
        # GRPO's layout: groups of `generations` rows with one prompt, the first row holding it.
        # Each row's own copy equals the first row's (as the engine copies it), so the outputs
        # must agree; the shared call reads the prefix from the first row of each group only.
        first = torch.arange(case.rows, device="cuda") // args.generations * args.generations
        case.cache_k[:, :, :args.prefix] = case.cache_k[first, :, :args.prefix]
        case.cache_v[:, :, :args.prefix] = case.cache_v[first, :, :args.prefix]
        prefix_rows = first.to(torch.int32)
        prefix_lens = torch.where(first == torch.arange(case.rows, device="cuda"), 0, args.prefix).to(torch.int32)

        def shared_kernel():
            return decode_attention(case.q, case.cache_k, case.cache_v, case.positions, case.cache_len,
                                    prefix_rows=prefix_rows, prefix_lens=prefix_lens)

        row["shared_prefix_us"] = time_us(shared_kernel)
        row["shared_prefix_speedup"] = row["triton_us"] / row["shared_prefix_us"]
        row["shared_prefix_max_abs_diff"] = (shared_kernel().float() - triton_kernel().float()).abs().max().item()
    for splits in (int(s) for s in args.splits.split(",") if s.strip()):
        row[f"triton_{splits}_splits_us"] = time_us(lambda: triton_kernel(splits))
    bytes_read = 2 * case.rows * case.kv_heads * case.keys * case.dim * 2
    for name in ("sdpa", "triton", "read_only"):
        row[f"{name}_gb_s"] = bytes_read / row[f"{name}_us"] / 1e3
    row["speedup"] = row["sdpa_us"] / row["triton_us"]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def sweep(case: Case, args) -> dict:
    """The kernel's launch configurations on one case: the five fastest and the default's time."""
    default = decode_attention(case.q, case.cache_k, case.cache_v, case.positions, case.cache_len).float()
    timings = []
    for block_n, warps, stages, splits in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4), (None, 1, 2, 4, 8)):
        def call(launch=(block_n, warps, stages), splits=splits):
            return decode_attention(case.q, case.cache_k, case.cache_v, case.positions, case.cache_len,
                                    num_splits=splits, launch=launch)
        try:
            error = (call().float() - default).abs().max().item()
            timings.append(dict(block_n=block_n, warps=warps, stages=stages, splits=splits,
                                us=time_us(call, calls=20, replays=5), max_abs_diff=error))
        except Exception as exc:  # a launch that does not fit (registers, shared memory)
            print(f"  {case.shape} {(block_n, warps, stages)} splits={splits}: {type(exc).__name__}", flush=True)
    timings.sort(key=lambda t: t["us"])
    default_key = (*default_launch(case.dim), None)
    default_us = next(t["us"] for t in timings if (t["block_n"], t["warps"], t["stages"], t["splits"]) == default_key)
    entry = dict(shape=case.shape, rows=case.rows, keys=case.keys, default_us=default_us, fastest=timings[:5])
    print(json.dumps(entry), flush=True)
    return entry


if __name__ == "__main__":
    main()
