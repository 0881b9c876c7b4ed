"""Per-token log-probabilities of sampled completions, without a `[B, T, vocab]` float32 tensor.

A float32 logits tensor at 16 × 1024 × 151,936 is 10 GB. Three choices keep the update phase's
memory and time proportional to the tokens that matter:

- **Length bucketing** (`Layout.plan`, cohort_grpo/rollout/layout.py): rows sorted by length fill
  micro-batches under a row and a token budget, so a batch of mostly short completions does not pay
  for its longest one.
- **Each prompt computed once per group** (`packing.pack_shared_prompts`; one row per completion,
  `packing.pack_micro_batch`, for models that only give logits).
- **A chunked LM head** (`lm_head_logprobs`): the head is applied to the completion tokens'
  hidden states a chunk of rows at a time, keeping only log π(token) and the entropy; the backward
  recomputes each chunk's logits instead of storing them (as Liger-Kernel's fused linear
  cross-entropy does for SFT). Peak memory is one chunk's logits, whatever the vocabulary × length.

Our own models give their final hidden states (`return_hidden=True`); other Hugging Face models
fall back to their logits, cut to the completion positions before any float32 copy.

Under top-k, top-p or min-p (a `Truncation`), log π(token) is that of the truncated distribution the
engine drew from, renormalised over the tokens it keeps (`rollout.sampling.kept_logits`), and its
gradient is that distribution's; the entropy stays the full softmax's (docs/concepts.md, "Truncated
sampling").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from cohort_grpo.rollout.layout import PADDED, Layout
from cohort_grpo.rollout.sampling import Truncation, kept_logits
from cohort_grpo.update.packing import MicroBatch, filler_micro_batches, pack

CHUNK_BYTES = 512 * 2**20  # float32 logits per LM-head chunk: 512 MiB (≈880 rows at a 152k vocabulary)


@dataclass
class TokenLogprobs:
    logp: Tensor  # [B, T] log π(token_t | prefix), float32, 0 where mask = 0
    entropy: Tensor | None  # [B, T] entropy of π(· | prefix), float32, when asked for


def selected_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                      truncation: Truncation | None = None):
    """log softmax(logits / temperature)[token] for each position, in float32 (and the entropy), over the
    tokens `truncation` keeps when given (the entropy stays the full softmax's).

    The plain computation: `logits` `[..., V]`, `tokens` `[...]`. Reference for the chunked path,
    and the path for models that only give logits."""
    if truncation is not None:
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
        logp, entropy, _, _ = truncated_stats(_chunk_forward, flat, flat_tokens, 1.0 / temperature, truncation)
        return logp.view(tokens.shape), entropy.view(tokens.shape) if with_entropy else None
    if with_entropy:
        logp, entropy, _ = _chunk_forward(logits, tokens, 1.0 / temperature)
        return logp, entropy
    z = logits.float() * (1.0 / temperature)
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1), None


def chunk_rows_for(vocab: int) -> int:
    return max(64, CHUNK_BYTES // (4 * vocab))


def _chunk_forward(logits: Tensor, tokens: Tensor, inv_temperature: float):
    """(log π(token), entropy, logsumexp) of one chunk's logits [n, V], in float32."""
    z = logits.float() * inv_temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy, lse


def truncated_stats(stats, logits: Tensor, tokens: Tensor, inv_temperature: float, truncation: Truncation | None):
    """A chunk's (log π(token), entropy, logsumexp, logsumexp over the kept tokens) from `stats` (one of
    `head_functions`'): with `truncation`, log π over `kept_logits` by the same `stats` (as the engine's
    exact sampler computes it), the entropy and first logsumexp of the full softmax; without, the last is
    the first."""
    logp, entropy, lse = stats(logits, tokens, inv_temperature)
    if truncation is None:
        return logp, entropy, lse, lse
    kept_logp, _, kept_lse = stats(kept_logits(logits, tokens, inv_temperature, truncation), tokens, inv_temperature)
    return kept_logp, entropy, lse, kept_lse


def _chunk_backward(logits: Tensor, tokens: Tensor, lse: Tensor, entropy: Tensor, grad_logp: Tensor,
                    grad_entropy: Tensor, inv_temperature: float) -> Tensor:
    """∂loss/∂logits [n, V] in the logits' dtype: with z = logits/T and p = softmax(z),
    ∂logp/∂z = onehot(token) − p and ∂H/∂z = −p ⊙ (log p + H)."""
    log_p = logits.float() * inv_temperature - lse[:, None]
    p = log_p.exp()
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == tokens[:, None]
    grad_z = torch.where(onehot, grad_logp[:, None], 0.0) - p * (grad_logp[:, None]
                                                                 + grad_entropy[:, None] * (log_p + entropy[:, None]))
    return (grad_z * inv_temperature).to(logits.dtype)


def _chunk_backward_logp_only(logits: Tensor, tokens: Tensor, lse: Tensor, grad_logp: Tensor,
                              inv_temperature: float) -> Tensor:
    """`_chunk_backward` when the entropy carries no gradient (it is only logged): one term less."""
    p = (logits.float() * inv_temperature - lse[:, None]).exp()
    onehot = torch.arange(logits.shape[-1], device=logits.device)[None, :] == tokens[:, None]
    grad_z = (onehot.float() - p) * grad_logp[:, None]
    return (grad_z * inv_temperature).to(logits.dtype)


_compiled: dict[str, object] = {}


def _maybe_compiled(name: str, plain, tensor: Tensor):
    """On a GPU, `plain` through torch.compile: the float32 work over [n, vocab] logits becomes one
    or two fused kernels that read the bf16 logits once, instead of a dozen full passes (at a 152k
    vocabulary the logits of one 512-token completion are 300 MB in float32). Plain on CPU, and
    after a compilation failure (one notice)."""
    if not tensor.is_cuda or _compiled.get(name) is False:
        return plain
    if name not in _compiled:
        # Static shapes first (the vocabulary never changes); a second row count makes torch.compile
        # recompile once with the row dimension alone dynamic.
        _compiled[name] = torch.compile(plain)
    compiled = _compiled[name]

    def call(*args):
        try:
            return compiled(*args)
        except Exception as error:  # no triton, or an op inductor cannot lower
            _compiled[name] = False
            print(f"cohort: compiling the LM-head log-prob kernel failed ({type(error).__name__}); "
                  "using plain ops", file=sys.stderr)
            return plain(*args)

    return call


def chunk_stats_function(tensor: Tensor):
    """(log π, entropy, logsumexp) of one chunk's logits: the one-pass Triton kernel on CUDA
    (`triton_logprobs`), else `_chunk_forward` (compiled on a GPU without the kernel)."""
    from cohort_grpo.kernels.elementwise import triton_allowed

    if triton_allowed(tensor):
        from cohort_grpo.kernels.logprobs import chunk_logprob_stats

        return chunk_logprob_stats
    return _maybe_compiled("forward", _chunk_forward, tensor)


def chunk_logits_plain(hidden: Tensor, weight: Tensor) -> Tensor:
    return hidden @ weight.T


@dataclass(frozen=True)
class SoftCap:
    """A head that soft-caps its logits (Gemma 2, Gemma 3n, ...): y = cap · tanh(scale · z / cap) for z = hidden @ Wᵀ,
    `scale` the head's logit scale, which comes before the cap."""
    cap: float
    scale: float = 1.0


def capped_logits(logits: Tensor, softcap: SoftCap | None) -> Tensor:
    """`logits` as a soft-capping head gives them (unchanged without one)."""
    if softcap is None:
        return logits
    return (torch.tanh(logits.float() * (softcap.scale / softcap.cap)) * softcap.cap).to(logits.dtype)


def head_functions(numerics: str, hidden: Tensor):
    """(logits of a chunk of hidden rows, its (log π, entropy, logsumexp)). Under exact numerics: the
    batch-invariant matmul and the one-pass Triton statistics, which the engine's sampler also runs on
    its logits (`rollout.sampling.sample_with_head_logprobs`), so the two log-probs are the same bits;
    else a plain GEMM and `chunk_stats_function`."""
    if numerics == "exact":
        from cohort_grpo.kernels import exact_matmul, logprobs as stats_kernels

        return exact_matmul.matmul, stats_kernels.chunk_logprob_stats
    return chunk_logits_plain, chunk_stats_function(hidden)


def model_numerics(model) -> str:
    """"fast" or "exact": how `model` (or the module a DDP/FSDP wrapper holds) computes (models/exact_layers.py)."""
    return getattr(getattr(model, "module", model), "numerics", "fast")


class _ChunkedLMHead(torch.autograd.Function):
    """(log π(token), entropy) per row of `hidden` [N, H] under the head `weight` [V, H].

    Only N floats per output and the logsumexp are kept; each chunk's logits are recomputed in
    the backward pass (one extra GEMM) instead of being stored."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, chunk: int,
                with_entropy: bool, numerics: str, truncation: Truncation | None, softcap: SoftCap | None):
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) gets None, not zeros
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy, lse, kept_lse = torch.empty_like(logp), torch.empty_like(logp), torch.empty_like(logp)
        logits_of, stats = head_functions(numerics, hidden)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            logp[part], entropy[part], lse[part], kept_lse[part] = truncated_stats(
                stats, capped_logits(logits_of(hidden[part], weight), softcap), tokens[part], 1.0 / temperature,
                truncation)
        if not with_entropy:
            entropy.zero_()
        ctx.save_for_backward(hidden, weight, tokens, entropy, lse, kept_lse)
        ctx.temperature, ctx.chunk, ctx.truncation, ctx.softcap = temperature, chunk, truncation, softcap
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, tokens, entropy, lse, kept_lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.float()
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            accumulate_chunk_grads(capped_logits(hidden[part] @ weight.T, ctx.softcap), hidden, weight, tokens[part],
                                   lse[part], entropy[part], grad_logp[part],
                                   None if grad_entropy is None else grad_entropy[part], 1.0 / ctx.temperature, part,
                                   grad_hidden, grad_weight, ctx.truncation, kept_lse[part], ctx.softcap)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def accumulate_chunk_grads(logits: Tensor, hidden: Tensor, weight: Tensor, tokens: Tensor, lse: Tensor,
                           entropy: Tensor, grad_logp: Tensor, grad_entropy: Tensor | None, inv_temperature: float,
                           part: slice, grad_hidden: Tensor | None, grad_weight: Tensor | None,
                           truncation: Truncation | None = None, kept_lse: Tensor | None = None,
                           softcap: SoftCap | None = None) -> None:
    """One chunk's share of ∂loss/∂hidden (written to `grad_hidden[part]`) and of ∂loss/∂W (added to
    `grad_weight`), from its logits [n, V] = hidden[part] Wᵀ (soft-capped by `softcap` when given) and the chunk's
    tokens, logsumexps, entropies and ∂loss/∂log π, ∂loss/∂H (None when the entropy is only logged), each [n]. With
    a `truncation`, log π's term is the truncated distribution's (over `kept_logits`, normalised by `kept_lse`)."""
    if truncation is not None:  # ∂log π/∂z = onehot − the kept tokens' renormalised probabilities
        kept = kept_logits(logits, tokens, inv_temperature, truncation)
        grad_logits = _maybe_compiled("backward_logp", _chunk_backward_logp_only, kept)(
            kept, tokens, kept_lse, grad_logp, inv_temperature)
        if grad_entropy is not None:
            grad_logits = grad_logits + _maybe_compiled("backward", _chunk_backward, logits)(
                logits, tokens, lse, entropy, torch.zeros_like(grad_logp), grad_entropy.float(), inv_temperature)
    elif grad_entropy is None:  # one term less
        grad_logits = _maybe_compiled("backward_logp", _chunk_backward_logp_only, logits)(
            logits, tokens, lse, grad_logp, inv_temperature)
    else:
        grad_logits = _maybe_compiled("backward", _chunk_backward, logits)(
            logits, tokens, lse, entropy, grad_logp, grad_entropy.float(), inv_temperature)
    if softcap is not None:  # through y = cap · tanh(scale · z / cap): ∂y/∂z = scale · (1 − (y / cap)²)
        slope = softcap.scale * (1 - (logits.float() / softcap.cap) ** 2)
        grad_logits = (grad_logits.float() * slope).to(grad_logits.dtype)
    if grad_hidden is not None:
        grad_hidden[part] = grad_logits @ weight
    if grad_weight is not None:  # accumulated in the GEMM itself, in the weight's dtype (bf16 on a GPU)
        grad_weight.addmm_(grad_logits.T, hidden[part])


def lm_head_logprobs(hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float = 1.0,
                     chunk_rows: int | None = None, with_entropy: bool = True,
                     numerics: str = "fast", truncation: Truncation | None = None,
                     softcap: SoftCap | None = None) -> tuple[Tensor, Tensor]:
    """Chunked (log π(token), entropy), each [N] float32, for hidden states [N, H] and tokens [N]
    (the entropy is zeros unless `with_entropy`; `numerics` as in `head_functions`; log π over the tokens
    `truncation` keeps when given; the logits soft-capped by `softcap` when given)."""
    chunk = chunk_rows or chunk_rows_for(weight.shape[0])
    return _ChunkedLMHead.apply(hidden, weight, tokens, float(temperature), int(chunk), bool(with_entropy), numerics,
                                truncation, softcap)


def is_fully_sharded(model) -> bool:
    """Whether `model` is sharded by FSDP2 (`fully_shard`): its forward all-gathers each layer's weights."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def supports_hidden(model) -> bool:
    """Our CausalLM can return its final hidden states instead of logits, and so can a `TransformersCausalLM` whose
    logits are its head's GEMM under a scale and soft-capping (`head_temperature`, `head_softcap`), no bias."""
    from cohort_grpo.models import CausalLM
    from cohort_grpo.models.generic import TransformersCausalLM

    inner = getattr(model, "module", model)
    return isinstance(inner, CausalLM) or (isinstance(inner, TransformersCausalLM) and inner.plain_head)


def head_temperature(model, temperature: float) -> float:
    """What the chunked LM head divides hidden @ weightᵀ by to give `model`'s logits over `temperature`: the
    temperature over the head's logit scale (Granite divides its logits, Cohere multiplies them:
    `LogitHead.scale`; cohort's own models have none), unless the head soft-caps, where the scale comes first
    (`head_softcap`)."""
    if head_softcap(model) is not None:
        return temperature
    inner = getattr(model, "module", model)
    return temperature / getattr(inner.lm_head, "scale", 1.0)


def head_softcap(model) -> SoftCap | None:
    """`model`'s final logit soft-capping (`LogitHead.softcap`, with its scale), None where its head has none."""
    head = getattr(getattr(model, "module", model), "lm_head", None)
    cap = getattr(head, "softcap", None)
    return None if cap is None else SoftCap(float(cap), getattr(head, "scale", 1.0))


def takes_attention_rows(model) -> bool:
    """Whether `model` runs the shared-prompt layout (one flat row of a prompt and its completions, attention rows
    saying what each token sees): `supports_hidden`, and no layer whose recurrent state would run through the other
    completions' tokens (linear attention). A vision-language model's images go in once per packed prompt."""
    inner = getattr(model, "module", model)
    return supports_hidden(model) and not getattr(inner, "keeps_recurrent_state", False)


def forward_hidden(model, micro: MicroBatch) -> Tensor:
    """Final normed hidden states [r, L, H] of `micro`'s forward rows: our CausalLM in either layout, or
    any model whose forward takes `return_hidden` in the one-row-per-completion layout."""
    routing = {} if micro.routing is None else {"routing": micro.routing}  # a MoE model's replay (models/moe.py)
    images = {} if micro.images is None else {"images": micro.images}  # a vision-language model's
    if micro.attention_rows is None:
        return model(micro.input_ids, return_hidden=True, **routing, **images)
    return model(micro.input_ids, position_ids=micro.position_ids, attention_rows=micro.attention_rows,
                 attention_slots=micro.attention_slots, return_hidden=True, **routing, **images)


def completion_hidden(model, micro: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Our CausalLM's final hidden states where they predict `micro`'s completion tokens [n, H], its
    LM-head weight [V, H], and those tokens [n], in the order of `token_rows`/`token_cols` (the
    mask's nonzeros, found on the CPU: no sync here). `model` may be a DDP/FSDP wrapper: its
    forward is what is called (the gradient hooks live there); the weight is the wrapped module's."""
    inner = getattr(model, "module", model)
    hidden = forward_hidden(model, micro)
    tokens = micro.completion_ids[micro.token_rows, micro.token_cols]
    return hidden[micro.source_rows, micro.source_cols], inner.lm_head.weight, tokens


def scatter_to_rows(values: Tensor, micro: MicroBatch) -> Tensor:
    """Per-token values [n] back to `micro`'s [b, T] layout, 0 off the mask."""
    out = torch.zeros(micro.completion_mask.shape, dtype=values.dtype, device=values.device)
    return out.index_put((micro.token_rows, micro.token_cols), values)


def micro_batch_logprobs(model, micro: MicroBatch, *, temperature: float = 1.0, with_entropy: bool = False,
                         chunk_rows: int | None = None, truncation: Truncation | None = None) -> TokenLogprobs:
    """Log-probs (and entropies) of `micro`'s completion tokens under `model`, [b, T] float32 (of the
    distribution `truncation` cuts, when given).

    `model` may be a DDP/FSDP wrapper: its forward is what is called (the gradient hooks live
    there); the LM head weight is read from the wrapped module."""
    if supports_hidden(model):
        hidden, weight, tokens = completion_hidden(model, micro)
        token_logp, token_entropy = lm_head_logprobs(hidden, weight, tokens, head_temperature(model, temperature),
                                                     chunk_rows, with_entropy, model_numerics(model), truncation,
                                                     head_softcap(model))
    else:
        if micro.attention_rows is not None:
            raise ValueError("a shared-prompt micro-batch needs our CausalLM (attention rows); pack it one row per completion")
        out = model(input_ids=micro.input_ids)
        logits = out if isinstance(out, Tensor) else out.logits
        rows, cols = micro.token_rows, micro.token_cols
        token_logp, token_entropy = selected_logprobs(logits[micro.source_rows, micro.source_cols],
                                                      micro.completion_ids[rows, cols],
                                                      temperature, with_entropy, truncation)
    logp = scatter_to_rows(token_logp, micro)
    entropy = scatter_to_rows(token_entropy, micro) if with_entropy else None
    return TokenLogprobs(logp, entropy)


def rollout_logprobs(model, prompt_ids: list[list[int]], completion_ids: Tensor, completion_mask: Tensor, *,
                     pad_id: int, max_rows: int, max_tokens: int = 0, temperature: float = 1.0,
                     layout: Layout = PADDED, routes: Tensor | None = None, replay: bool = True,
                     agree: Callable[[int], int] | None = None, truncation: Truncation | None = None,
                     images: list | None = None) -> Tensor:
    """[B, T] float32 log-probs of a whole rollout's completions, no gradient (log π_old, log π_ref):
    length-bucketed micro-batches under inference mode, scattered back to rollout order on the
    model's device and copied to the CPU once, at the end (one host sync per pass), laid out and planned as
    `layout` says (default: one padded row per completion, which any model runs). `routes`: a
    mixture-of-experts rollout's recorded experts, routed by with `replay` (packing.pack). `agree`: given the
    number of micro-batches this rank planned, how many forwards to run (as many as the other FSDP2 ranks run;
    the extra ones discarded, `packing.filler_micro_batches`). `truncation`: the sampler's top-k / top-p / min-p, whose
distribution the log-probs are of. `images`: each row's prompt images, for a vision-language model."""
    device = next(model.parameters()).device
    full = torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
    plans = layout.plan(prompt_ids, completion_mask, max_rows, max_tokens, images)
    # FSDP2 gathers into buffers it reuses in training: made under inference mode they could not be written again.
    with torch.no_grad() if is_fully_sharded(model) else torch.inference_mode():
        forwards = agree(len(plans)) if agree is not None else len(plans)
        for i, rows in enumerate(plans + filler_micro_batches(plans, forwards)):
            micro = pack(prompt_ids, completion_ids, completion_mask, rows, pad_id, layout,
                         routes=routes, replay=replay, images=images).to(device)
            logp = micro_batch_logprobs(model, micro, temperature=temperature, truncation=truncation).logp
            if i < len(plans):
                full[micro.row_index, : logp.shape[1]] = logp
    return full.cpu()
