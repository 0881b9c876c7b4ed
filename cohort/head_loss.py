"""The GRPO loss of one micro-batch, with the LM head fused into the loss where it can be.

The chunked head (`logprobs.lm_head_logprobs`) keeps memory flat but computes each chunk's logits
twice: in the forward pass and again in the backward pass, because ∂loss/∂logits needs the
upstream gradient ∂loss/∂log π, which exists only once the loss does. When the loss is a weighted
sum of per-token terms, loss = Σ_t w_t ℓ_t(log π_t, H_t) — GRPO, DAPO and Dr. GRPO with token-level
importance ratios are (`algo.per_token_policy_loss` and `aggregate_loss`'s weights) — that
gradient is known as soon as a chunk's log π is: g_t = w_t ∂ℓ_t/∂log π_t. So each chunk's logits are
computed once, and give at once the chunk's log-probs, its loss, and its share of ∂loss/∂hidden
and ∂loss/∂W, kept for the backward pass, which only scales them. One [chunk × vocab] GEMM of four
is saved. (Liger-Kernel's fused linear cross-entropy does the same for SFT's cross-entropy,
whose weights are constant.)

GSPO's sequence-level ratio couples all tokens of a completion, and models that only give
logits have no separate head: both take the plain path, `policy_loss` over
`micro_batch_logprobs`, which computes the same loss and gradient.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .algo import aggregate_loss, per_token_policy_loss, policy_loss, policy_loss_stats
from .logprobs import (TokenLogprobs, _chunk_rows, accumulate_chunk_grads, chunk_stats_function, completion_hidden,
                       micro_batch_logprobs, scatter_to_rows, supports_hidden)
from .packing import MicroBatch

# ℓ(log π, entropy, chunk) for the tokens of `chunk` (a slice of the micro-batch's completion tokens)
TokenLoss = Callable[[Tensor, Tensor, slice], Tensor]


def token_loss_weights(mask: Tensor, loss_type: str, max_completion_length: int | None = None,
                       num_tokens: float | None = None) -> Tensor:
    """[B, T] weight of each token's loss in `aggregate_loss`, which is linear in the per-token
    losses, so its gradient at any point is the weights: aggregate_loss keeps every
    length-normalisation choice in one place, and this reads them off it."""
    probe = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate_loss(probe, mask, loss_type, max_completion_length, num_tokens),
                                         probe)
    return weights


class _HeadWithTokenLoss(torch.autograd.Function):
    """(Σ_t w_t ℓ_t, log π_t, H_t) for hidden states [N, H], head `weight` [V, H], tokens [N] and
    per-token weights [N]; the gradients are computed in the forward pass, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, weights: Tensor, token_loss: TokenLoss,
                temperature: float, chunk: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        stats = chunk_stats_function(hidden)
        inv_temperature = 1.0 / temperature
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            logits = hidden[part] @ weight.T
            chunk_logp, chunk_entropy, lse = stats(logits, tokens[part], inv_temperature)
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
                                       grad_entropy, inv_temperature, part, grad_hidden, grad_weight)
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
        return grad_hidden, grad_weight, None, None, None, None, None


def head_with_token_loss(hidden: Tensor, weight: Tensor, tokens: Tensor, weights: Tensor, token_loss: TokenLoss,
                         temperature: float = 1.0, chunk_rows: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, log π [N], entropy [N]) with loss = Σ_t weights_t · token_loss(log π, H, chunk)_t over the
    head's softmax(hidden W^T / temperature); log π and H carry no gradient, the loss does."""
    chunk = chunk_rows or _chunk_rows(weight.shape[0])
    return _HeadWithTokenLoss.apply(hidden, weight, tokens, weights, token_loss, float(temperature), int(chunk))


def micro_batch_policy_loss(model, micro: MicroBatch, *, old_logp: Tensor | None, ref_logp: Tensor | None,
                            advantages: Tensor, loss_mask: Tensor, temperature: float = 1.0, fused: bool = True,
                            epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                            loss_type: str = "grpo", max_completion_length: int | None = None,
                            num_tokens: float | None = None, importance_sampling_level: str = "token",
                            entropy_coef: float = 0.0, chunk_rows: int | None = None
                            ) -> tuple[Tensor, dict[str, Tensor], TokenLogprobs]:
    """`policy_loss` of `micro`'s completions under `model`: (loss, statistics, detached log-probs
    and entropies [b, T]). The same value and gradient as
    `policy_loss(micro_batch_logprobs(model, micro, with_entropy=True).logp, ...)`, which is the
    path taken when `fused` is off or cannot apply.

    old_logp: [b, T] log π_old, or None for μ = 1, where π_old is π_θ itself (ratio 1, gradient of
    log π); ref_logp: [b, T] or None; advantages: [b] or [b, T]; loss_mask: [b, T], the completion
    mask with any row left out of the loss zeroed.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if not (fused and importance_sampling_level == "token" and supports_hidden(model)):
        out = micro_batch_logprobs(model, micro, temperature=temperature, with_entropy=True, chunk_rows=chunk_rows)
        old = out.logp.detach() if old_logp is None else old_logp
        loss, stats = policy_loss(
            out.logp, old, advantages, loss_mask, ref_logp=ref_logp, epsilon=epsilon, epsilon_high=eps_high,
            beta=beta, loss_type=loss_type, max_completion_length=max_completion_length, num_tokens=num_tokens,
            importance_sampling_level=importance_sampling_level, entropy=out.entropy, entropy_coef=entropy_coef)
        return loss, stats, TokenLogprobs(out.logp.detach(), out.entropy.detach())

    rows, cols = micro.token_rows, micro.token_cols
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).float().expand(loss_mask.shape)
    token_adv = adv[rows, cols]
    token_old = None if old_logp is None else old_logp[rows, cols]
    token_ref = None if ref_logp is None else ref_logp[rows, cols]

    def token_loss(logp: Tensor, entropy: Tensor, part: slice) -> Tensor:
        log_ratio = logp - (logp.detach() if token_old is None else token_old[part])
        return per_token_policy_loss(logp, log_ratio, token_adv[part],
                                     ref_logp=None if token_ref is None else token_ref[part], epsilon=epsilon,
                                     epsilon_high=eps_high, beta=beta, entropy=entropy, entropy_coef=entropy_coef)

    hidden, weight, tokens = completion_hidden(model, micro)
    weights = token_loss_weights(loss_mask, loss_type, max_completion_length, num_tokens)[rows, cols]
    loss, token_logp, token_entropy = head_with_token_loss(hidden, weight, tokens, weights, token_loss, temperature,
                                                           chunk_rows)
    logp, entropy = scatter_to_rows(token_logp, micro), scatter_to_rows(token_entropy, micro)
    log_ratio = torch.zeros_like(logp) if old_logp is None else logp - old_logp
    stats = policy_loss_stats(logp, log_ratio, adv, loss_mask, ref_logp, epsilon, eps_high)
    return loss, stats, TokenLogprobs(logp, entropy)
