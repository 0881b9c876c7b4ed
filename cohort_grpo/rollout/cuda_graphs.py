"""CUDA-graph capture of the decode step, one graph per (batch width, KV length) bucket.

A decode step of a small model is dominated by kernel-launch overhead (hundreds of small kernels
per token); replaying a captured graph launches them all at once (PyTorch "CUDA Graphs" docs,
torch.cuda.graphs). The step reads its inputs from tensors whose storage never changes (the
`SlotState` and the `KVCache`), so a graph captured once stays valid for every later replay;
graphs are captured lazily, the first time a bucket is needed, and share one memory pool.

The whole step is captured: model forward, sampling (its random numbers come from a counter-based
hash of device tensors, see `sampling.gumbel_noise`, so no generator state is involved) and the
slot-state update. A replay therefore changes state; warm-up and capture runs restore the state
tensors they touched, so capturing a graph never advances decoding.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

DecodeStep = Callable[..., tuple[torch.Tensor, ...]]  # step(*key) -> output tensors (tokens, log-probs)


class DecodeGraphs:
    """Runs `step(*key)` eagerly, or through a CUDA graph captured once per key when `enabled`
    (key: width, KV length, sampling settings: everything that is baked into the kernels).

    `state` returns the tensors a step writes besides the KV cache (whose rewrites are
    idempotent); they are restored after warm-up and capture.
    `verify=True` compares each freshly captured graph's first replay with an eager run of the
    same step and raises on a mismatch (the self-check the benchmark's --check mode turns on);
    `check=True` makes the same comparison and treats a mismatch as a failed capture.
    When capture itself fails (a model that syncs with the host, say), one notice is printed
    and the step runs eagerly from then on, so sampling still works, only slower.
    """

    def __init__(self, step: DecodeStep, enabled: bool, state: Callable[[], list[torch.Tensor]],
                 verify: bool = False, warmup_runs: int = 2, check: bool = False):
        self.step = step
        self.state = state
        self.enabled = enabled
        self.verify = verify
        self.check = check
        self.warmup_runs = warmup_runs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = None
        self.side_stream = None  # the warm-up stream, created on first capture
        self.captures = 0
        self.max_verify_error = 0.0
        self.weights_key = None  # the addresses of the weights the graphs read (`follow_weights`)

    def __call__(self, *key) -> tuple[torch.Tensor, ...]:
        if not self.enabled:
            return self.step(*key)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key)
            except Exception as error:  # noqa: BLE001 - any capture failure degrades to eager
                if self.verify:
                    raise
                print(f"cohort engine: CUDA graph capture failed ({type(error).__name__}: {error}); "
                      "decoding without CUDA graphs", file=sys.stderr)
                self.enabled = False
                self.graphs.clear()
                return self.step(*key)
            self.graphs[key] = entry
        graph, outputs = entry
        graph.replay()
        return outputs

    def _capture(self, key: tuple) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        tensors = self.state()
        saved = [t.clone() for t in tensors]

        def restore() -> None:
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)

        # Warm up on a side stream first (cuBLAS handles, lazy kernels, torch.compile), as the
        # PyTorch docs advise. Each run starts from the saved state and rewrites the same keys and
        # values at the same positions, so it leaves no trace once the state is restored.
        # One side stream for every capture: with a new stream each time, every capture left ~32 MiB
        # allocated for good (per-stream cuBLAS state; bench/sampling_memory.py measured the leak).
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream()
        side = self.side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                restore()
                eager = [t.clone() for t in self.step(*key)]
            restore()
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: an asynchronous-rollout producer may capture while the main thread launches work
        # (the default "global" mode would make that work an error inside the capture).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.step(*key)
        restore()
        self.captures += 1
        if self.verify or self.check:
            graph.replay()
            for got, expected in zip(outputs, eager):
                if not got.is_floating_point():  # sampled tokens: the replay must draw the same ones
                    if not torch.equal(got, expected):
                        raise RuntimeError(f"CUDA graph self-check failed at {key}: the replay sampled other tokens")
                    continue
                error = (got.float() - expected.float()).abs().max().item()
                scale = expected.float().abs().max().item() + 1e-6
                self.max_verify_error = max(self.max_verify_error, error / scale)
                if error > 1e-2 * scale:
                    raise RuntimeError(f"CUDA graph self-check failed at {key}: max |graph - eager| = "
                                       f"{error:.3g} (scale {scale:.3g})")
            restore()
        return graph, tuple(outputs)

    def clear(self) -> None:
        """Drop every captured graph (the cache or state they read was reallocated)."""
        self.graphs.clear()
        self.pool = None

    def follow_weights(self, model) -> None:
        """Graphs read the weights by address too: recapture if the model's tensors were replaced
        (in-place optimizer updates keep the addresses, so the usual case recaptures nothing)."""
        weights_key = tuple(p.data_ptr() for p in model.parameters())
        if weights_key != self.weights_key:
            self.clear()
            self.weights_key = weights_key
