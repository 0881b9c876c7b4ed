"""What an `Engine` call (engine.py) sets up before its loop runs: the mode the model samples in, the KV length of
the call's rows, and whether the KV cache kept from the last call serves this one.

`sampling_mode`: eval mode, inference mode and, when asked, the compiled fused kernels
(`cohort_grpo.kernels.elementwise`); `fuse_projections`: the model's q/k/v and gate/up as one matrix each. KV
lengths are rounded up to `KV_LENGTH_STEP`, so a later call can reuse the cache and few (width, KV length) CUDA
graphs exist (`sequence_capacity`); a cache is reused while it has the rows, the length, the dtype and the device a
call needs (`cache_fits`).
"""

from __future__ import annotations

import contextlib

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.kernels.elementwise import fused_kernels
from cohort_grpo.models.cache import KVCache

KV_LENGTH_STEP = 128  # cache lengths are rounded up to this so few (width, length) graphs exist


@contextlib.contextmanager
def sampling_mode(model: torch.nn.Module, fused: bool = False):
    """Eval mode, inference mode and (when asked) the compiled fused kernels while sampling; the
    caller's train/eval mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode(), fused_kernels(fused):
            yield
    finally:
        model.train(was_training)


def sequence_capacity(max_seq_len: int | None, cache: KVCache | None, longest_prompt: int, needed: int) -> int:
    """KV length per row for prompts of up to `longest_prompt` tokens that need `needed` in all: the engine's
    `max_seq_len` when set, else the kept `cache`'s length when it suffices, else `needed` rounded up."""
    if max_seq_len is not None:
        if longest_prompt >= max_seq_len:
            raise CohortError(f"a prompt has {longest_prompt} tokens, max_seq_len is {max_seq_len}: "
                              "shorten the prompts or raise max_seq_len")
        return max_seq_len
    if cache is not None and cache.max_len >= needed:
        return cache.max_len
    return -(-needed // KV_LENGTH_STEP) * KV_LENGTH_STEP


def cache_fits(cache: KVCache | None, model, rows: int, max_len: int) -> bool:
    """Whether `cache` serves a call over `rows` rows of `max_len` tokens of `model`."""
    return (cache is not None and cache.num_rows >= rows and cache.max_len == max_len
            and cache.dtype == model.dtype and cache.device == model.device)


def fuse_projections(model) -> None:
    """Fewer, larger GEMMs per step (`CausalLM.fuse_projections`, where the model has it); a no-op once fused.
    It may re-point parameters, which must not become inference tensors (training uses them next), hence outside
    inference mode."""
    if hasattr(model, "fuse_projections"):
        with torch.inference_mode(False):
            model.fuse_projections()
