"""A log-prob backend that fuses the LM head into the policy loss's gradient.

The chunked head (`logprobs.lm_head_logprobs`) keeps memory flat but computes each chunk's logits
twice: in the forward pass and again in the backward pass, because ∂loss/∂logits needs the
upstream gradient ∂loss/∂log π, which exists only once the loss does. When the loss is a weighted
sum of per-token terms, loss = Σ_t w_t ℓ_t(log π_t, H_t) — GRPO, DAPO and Dr. GRPO with token-level
importance ratios are (`objectives.policy_loss`: `per_token_policy_loss` weighted by
`token_weights`) — that gradient is known as soon as a chunk's log π is: g_t = w_t ∂ℓ_t/∂log π_t.
So each chunk's logits are computed once, and give at once the chunk's log-probs, its loss, and
its share of ∂loss/∂hidden and ∂loss/∂W, kept for the backward pass, which only scales them. One
[chunk × vocab] GEMM of four is saved. (Liger-Kernel's fused linear cross-entropy does the same for
SFT's cross-entropy, whose weights are constant.)

This file holds no loss: `FusedHead` is what `objectives.policy_loss` receives in place of the
log-probs, and `policy_loss` hands it the per-token loss and weights. GSPO's sequence-level ratio
couples all tokens of a completion, and models that only give logits have no separate head: both
take the plain path, `policy_loss` over `micro_batch_logprobs`, the same loss and gradient
(`micro_batch_policy_loss` picks).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from cohort_grpo.algorithm.loss_spec import BatchShare, LossSpec
from cohort_grpo.algorithm.objectives import DEFAULT_SPEC, PolicyLossOutput, policy_loss
from cohort_grpo.rollout.sampling import Truncation
from cohort_grpo.update.logprobs import (SoftCap, accumulate_chunk_grads, capped_logits, chunk_rows_for,
                                         completion_hidden, head_functions, head_softcap, head_temperature,
                                         micro_batch_logprobs, model_numerics, scatter_to_rows, supports_hidden,
                                         truncated_stats)
from cohort_grpo.update.packing import MicroBatch

# ℓ(log π, entropy, token rows, token cols) for the tokens of one chunk, in the micro-batch's [b, T] layout
TokenLoss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class _HeadWithTokenLoss(torch.autograd.Function):
    """(Σ_t w_t ℓ_t, log π_t, H_t) for hidden states [N, H], head `weight` [V, H], tokens [N] and
    per-token weights [N]; the gradients are computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, weights: Tensor, token_loss: Callable,
                temperature: float, chunk: int, numerics: str, truncation: Truncation | None,
                softcap: SoftCap | None):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        logits_of, stats = head_functions(numerics, hidden)
        inv_temperature = 1.0 / temperature
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            logits = capped_logits(logits_of(hidden[part], weight), softcap)
            chunk_logp, chunk_entropy, lse, kept_lse = truncated_stats(stats, logits, tokens[part], inv_temperature,
                                                                       truncation)
            logp[part], entropy[part] = chunk_logp, chunk_entropy
            with torch.enable_grad():
                logp_leaf = chunk_logp.detach().requires_grad_()
                entropy_leaf = chunk_entropy.detach().requires_grad_()
                chunk_loss = (token_loss(logp_leaf, entropy_leaf, part) * weights[part]).sum()
                grad_logp, grad_entropy = torch.autograd.grad(chunk_loss, (logp_leaf, entropy_leaf),
                                                              allow_unused=True)
            loss += chunk_loss.detach()
            if grad_hidden is not None or grad_weight is not None:
                grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
                accumulate_chunk_grads(logits, hidden, weight, tokens[part], lse, chunk_entropy, grad_logp,
                                       grad_entropy, inv_temperature, part, grad_hidden, grad_weight, truncation,
                                       kept_lse, softcap)
        ctx.grads = grad_hidden, grad_weight
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_logp, _grad_entropy):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        scale = grad_loss.float()
        if grad_hidden is not None:
            grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(scale.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def head_with_token_loss(hidden: Tensor, weight: Tensor, tokens: Tensor, weights: Tensor,
                         token_loss: Callable[[Tensor, Tensor, slice], Tensor], temperature: float = 1.0,
                         chunk_rows: int | None = None, numerics: str = "fast",
                         truncation: Truncation | None = None,
                         softcap: SoftCap | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, log π [N], entropy [N]) with loss = Σ_t weights_t · token_loss(log π, H, chunk)_t over the
    head's softmax(hidden W^T / temperature) (log π over the tokens `truncation` keeps, when given); log π
    and H carry no gradient, the loss does; the logits soft-capped by `softcap` when given."""
    chunk = chunk_rows or chunk_rows_for(weight.shape[0])
    return _HeadWithTokenLoss.apply(hidden, weight, tokens, weights, token_loss, float(temperature), int(chunk),
                                    numerics, truncation, softcap)


class FusedHead:
    """`model`'s LM head over `micro`'s completion tokens as a `objectives.FusedTokenLossHead`."""

    def __init__(self, model, micro: MicroBatch, temperature: float = 1.0, chunk_rows: int | None = None,
                 truncation: Truncation | None = None):
        self.model, self.micro, self.temperature, self.chunk_rows = model, micro, temperature, chunk_rows
        self.truncation = truncation

    def weighted_token_loss(self, token_loss: TokenLoss, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(Σ_t w_t ℓ_t, log π [b, T], entropy [b, T]) over the micro-batch's completion tokens."""
        micro = self.micro
        rows, cols = micro.token_rows, micro.token_cols

        def chunk_loss(logp: Tensor, entropy: Tensor, part: slice) -> Tensor:
            return token_loss(logp, entropy, rows[part], cols[part])

        hidden, weight, tokens = completion_hidden(self.model, micro)
        loss, token_logp, token_entropy = head_with_token_loss(hidden, weight, tokens, weights[rows, cols], chunk_loss,
                                                               head_temperature(self.model, self.temperature),
                                                               self.chunk_rows,
                                                               model_numerics(self.model), self.truncation,
                                                               head_softcap(self.model))
        return loss, scatter_to_rows(token_logp, micro), scatter_to_rows(token_entropy, micro)


def micro_batch_policy_loss(model, micro: MicroBatch, *, old_logp: Tensor | None, ref_logp: Tensor | None,
                            advantages: Tensor, loss_mask: Tensor, spec: LossSpec = DEFAULT_SPEC,
                            share: BatchShare | None = None, sampling_logp: Tensor | None = None,
                            temperature: float = 1.0, fused: bool = True,
                            chunk_rows: int | None = None, truncation: Truncation | None = None) -> PolicyLossOutput:
    """`objectives.policy_loss` of `micro`'s completions under `model`, with the log-probs from the
    fused head where it applies (`fused`, token-level ratios, a model that gives hidden states), else
    from `micro_batch_logprobs`. Same value and gradient either way.

    old_logp: [b, T] log π_old, or None for μ = 1, where π_old is π_θ itself (ratio 1, gradient of
    log π); ref_logp: [b, T] or None; advantages: [b] or [b, T]; loss_mask: [b, T], the completion
    mask with any row left out of the loss zeroed; sampling_logp: [b, T], the sampler's log-probs.
    `spec` and `share` go to `policy_loss` as they are. `truncation`: the sampler's top-k / top-p / min-p;
    log π_θ is then of the truncated distribution, as π_old's and the sampler's are.
    """
    # A sequence-level sampler correction needs each completion's whole ratio before the head runs.
    sequence_weights_unknown = sampling_logp is not None and old_logp is None and spec.sequence_correction
    if fused and spec.importance_sampling_level == "token" and supports_hidden(model) and not sequence_weights_unknown:
        head = FusedHead(model, micro, temperature, chunk_rows, truncation)
        return policy_loss(head, old_logp, advantages, loss_mask, spec, ref_logp=ref_logp, sampling_logp=sampling_logp,
                           share=share)
    out = micro_batch_logprobs(model, micro, temperature=temperature, with_entropy=True, chunk_rows=chunk_rows,
                               truncation=truncation)
    return policy_loss(out.logp, old_logp, advantages, loss_mask, spec, ref_logp=ref_logp, entropy=out.entropy,
                       sampling_logp=sampling_logp, share=share)
