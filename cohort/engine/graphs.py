"""CUDA-graph capture of the decode step, one graph per (batch width, KV length) bucket.

A decode step of a small model is dominated by kernel-launch overhead (hundreds of small kernels
per token); replaying a captured graph launches them all at once (PyTorch "CUDA Graphs" docs,
torch.cuda.graphs). The step reads its inputs from tensors whose storage never changes (the
`SlotState` and the `KVCache`), so a graph captured once stays valid for every later replay;
graphs are captured lazily, the first time a bucket is needed, and share one memory pool.

Only the model forward is captured. Sampling runs eagerly after it, so a seeded
`torch.Generator` drives it without registering generator state with the graph.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

DecodeStep = Callable[[int, int], torch.Tensor]  # (width, cache_len) -> logits [width, V]


class DecodeGraphs:
    """Runs `step(width, cache_len)` eagerly, or through a captured CUDA graph when `enabled`.

    `verify=True` compares each freshly captured graph's first replay with an eager run of the
    same step and raises on a mismatch (the self-check the benchmark's --check mode turns on).
    When capture itself fails (a model that syncs with the host, say), one notice is printed
    and the step runs eagerly from then on, so sampling still works, only slower.
    """

    def __init__(self, step: DecodeStep, enabled: bool, verify: bool = False, warmup_runs: int = 2):
        self.step = step
        self.enabled = enabled
        self.verify = verify
        self.warmup_runs = warmup_runs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.captures = 0
        self.max_verify_error = 0.0

    def __call__(self, width: int, cache_len: int) -> torch.Tensor:
        if not self.enabled:
            return self.step(width, cache_len)
        key = (width, cache_len)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(width, cache_len)
            except Exception as error:  # noqa: BLE001 - any capture failure degrades to eager
                if self.verify:
                    raise
                print(f"cohort engine: CUDA graph capture failed ({type(error).__name__}: {error}); "
                      "decoding without CUDA graphs", file=sys.stderr)
                self.enabled = False
                self.graphs.clear()
                return self.step(width, cache_len)
            self.graphs[key] = entry
        graph, logits = entry
        graph.replay()
        return logits

    def _capture(self, width: int, cache_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (cuBLAS handles, lazy kernels), as the PyTorch docs advise.
        # Re-running the step is harmless: it rewrites the same keys/values at the same positions.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                eager_logits = self.step(width, cache_len)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.step(width, cache_len)
        self.captures += 1
        if self.verify:
            expected = eager_logits.float().clone()
            graph.replay()
            error = (logits.float() - expected).abs().max().item()
            scale = expected.abs().max().item() + 1e-6
            self.max_verify_error = max(self.max_verify_error, error / scale)
            if error > 1e-2 * scale:
                raise RuntimeError(
                    f"CUDA graph self-check failed at width {width}, cache_len {cache_len}: "
                    f"max |graph - eager| = {error:.3g} (logit scale {scale:.3g})"
                )
        return graph, logits

    def clear(self) -> None:
        """Drop every captured graph (the cache or state they read was reallocated)."""
        self.graphs.clear()
        self.pool = None
