"""How the engine draws tokens from whatever logits its model returns.

A plain model returns the logits of the whole vocabulary: `sampling.sample_from_logits` draws from them
(on CUDA, plain temperature sampling is its one-pass Triton kernel). A tensor-parallel shard
(cohort_grpo/models/tensor_parallel.py) returns only its rank's slice of the vocabulary. Gathering the full
logits each step would move (T-1)/T of a [B, V] tensor to every rank, so the ranks sample over their
slices instead (`vocab_parallel.sample_vocab_parallel`), exchanging a few numbers per row, and all draw
the tokens one process draws from the full logits with the same seed.

The engine picks the sampler once per model (`token_sampler`) and hands it to the decode step and to
prefill. The decode step of a shard holds collectives, which a CUDA graph can capture (NCCL), except
where the sampler reads the host (`graph_capturable`).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist

from cohort_grpo.errors import CohortError
from cohort_grpo.models.tensor_parallel import SIZE_OPTION, TensorParallelCausalLM
from cohort_grpo.rollout.sampling import sample_from_logits, sample_with_head_logprobs
from cohort_grpo.rollout.vocab_parallel import reads_host, sample_vocab_parallel

TokenSampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # sample_from_logits's signature


def tensor_parallel_size(model) -> int:
    """How many ranks `model`'s layers are split over: 1 unless it is a tensor-parallel shard."""
    return model.tensor_parallel_size if isinstance(model, TensorParallelCausalLM) else 1


def token_sampler(model) -> TokenSampler:
    """`sample_from_logits` itself for a model that returns the whole vocabulary's logits (nothing in
    between, so the single-GPU path is unchanged); for a shard of T > 1 ranks, the vocabulary-parallel
    sampler over its slice, with the same arguments."""
    if tensor_parallel_size(model) == 1:
        # exact numerics: the recorded log-prob is the trainer's, computed by its own kernel
        return sample_with_head_logprobs if getattr(model, "numerics", "fast") == "exact" else sample_from_logits
    vocab_size, rows, size = model.full_config.vocab_size, model.config.vocab_size, model.tensor_parallel_size
    if (size - 1) * rows >= vocab_size:  # the same test on every rank: all of them refuse together
        raise CohortError(f"a vocabulary of {vocab_size} tokens split into slices of {rows} leaves the last of "
                          f"{size} ranks no token to sample; choose a smaller {SIZE_OPTION}")
    return functools.partial(_sample_slice, width=model.vocab_stop - model.vocab_start,
                             vocab_start=model.vocab_start, vocab_size=vocab_size, group=model.group)


def _sample_slice(logits: torch.Tensor, *args, width: int, **slice_options):
    # The last ranks' slices are padded past the vocabulary with -inf columns; the sampler wants slices
    # that tile the vocabulary exactly, so it gets the real columns (a view: nothing is copied).
    return sample_vocab_parallel(logits[:, :width], *args, **slice_options)


def graph_capturable(model, sampling: tuple) -> bool:
    """Whether a decode step of `model` with the sampling key (temperature, top_k, top_p, min_p) can be
    captured in a CUDA graph. A shard's all-reduces and all-gathers can (NCCL supports capture), but
    top-p without top-k reads on the host whether to gather again (vocab_parallel.py): a graph would
    replay the one decision made at capture. The engine decodes that mode eagerly, which is slower but
    exact, rather than refusing a setting that sampling on one GPU accepts."""
    return tensor_parallel_size(model) == 1 or not reads_host(*sampling, vocab_size=model.full_config.vocab_size)


def shared_seed(model, seed: int) -> int:
    """`seed` for a plain model; rank 0's for every rank of a shard's group (one broadcast), so that a
    call without a fixed seed draws, on all ranks, the noise one process draws with that seed."""
    if tensor_parallel_size(model) == 1:
        return seed
    value = torch.tensor([seed], dtype=torch.long, device=model.device)
    dist.broadcast(value, group_src=0, group=model.group)
    return int(value.item())
