"""Per-token log-probabilities of sampled completions, without a `[B, T, vocab]` float32 tensor.

A float32 logits tensor at 16 × 1024 × 151,936 is 10 GB. Three choices keep the update phase's
memory and time proportional to the tokens that matter:

- **Length bucketing** (`plan_micro_batches`): rows sorted by length fill micro-batches under a
  row and a token budget, so a batch of mostly short completions does not pay for its longest one.
- **Right padding** (`pack_micro_batch`): each row is [prompt | completion | pad]. Causal attention
  never looks right, so pads need no attention mask and SDPA runs its mask-free (flash) kernel;
  positions are plain 0..L-1, as when the tokens were sampled.
- **A chunked LM head** (`lm_head_logprobs`): the head is applied to the completion tokens'
  hidden states a chunk of rows at a time, keeping only log π(token) and the entropy; the backward
  recomputes each chunk's logits instead of storing them (as Liger-Kernel's fused linear
  cross-entropy does for SFT). Peak memory is one chunk's logits, whatever the vocabulary × length.

Our own models give their final hidden states (`return_hidden=True`); other Hugging Face models
fall back to their logits, cut to the completion positions before any float32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import sys

import torch
from torch import Tensor

CHUNK_BYTES = 512 * 2**20  # float32 logits per LM-head chunk: 512 MiB (≈880 rows at a 152k vocabulary)


@dataclass
class TokenLogprobs:
    logp: Tensor  # [B, T] log π(token_t | prefix), float32, 0 where mask = 0
    entropy: Tensor | None  # [B, T] entropy of π(· | prefix), float32, when asked for


@dataclass
class MicroBatch:
    """Rows `rows` of a rollout, right-padded for one forward pass. Every index a forward needs is
    computed on the CPU when the micro-batch is packed, so using it on a GPU needs no host sync."""

    rows: list[int]  # indices into the rollout, in this micro-batch's order
    input_ids: Tensor  # [b, L] long: prompt, completion, then pad
    completion_ids: Tensor  # [b, T] long, T = the longest completion here
    completion_mask: Tensor  # [b, T] 1 on completion tokens
    prompt_lengths: Tensor  # [b] long
    row_index: Tensor  # [b] long: `rows` as a tensor, to gather per-rollout tensors on the device
    token_rows: Tensor  # [n] long: the micro-batch row of each completion token (row-major order)
    token_cols: Tensor  # [n] long: its column in the completion

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> "MicroBatch":
        """The tensors on `device`. To a GPU they go from pinned memory without blocking: a plain
        copy from pageable memory would wait for every queued kernel first, so the GPU would idle
        while the host queues each micro-batch's forward."""
        device = torch.device(device)
        return MicroBatch(self.rows, *(to_device(t, device) for t in (
            self.input_ids, self.completion_ids, self.completion_mask, self.prompt_lengths, self.row_index,
            self.token_rows, self.token_cols)))


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` on `device`; CPU → CUDA through pinned memory without a host sync."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def plan_micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Split rows into micro-batches of similar length: at most `max_rows` rows each and, when
    `max_tokens` > 0, at most `max_tokens` padded tokens (rows × the longest row) each.

    Rows are taken longest first, so each micro-batch's padding is only the difference between
    neighbours in the sorted order. Deterministic (ties keep row order). A single row longer than
    `max_tokens` still gets a micro-batch of its own.

    >>> plan_micro_batches([5, 100, 6, 90], max_rows=2)
    [[1, 3], [2, 0]]
    """
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: a micro-batch needs at least one row")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plans: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        too_many_tokens = max_tokens > 0 and (len(current) + 1) * longest > max_tokens
        if current and (len(current) >= max_rows or too_many_tokens):
            plans.append(current)
            current = []
        current.append(i)
    if current:
        plans.append(current)
    return plans


def plan_rollout(prompt_ids: list[list[int]], completion_mask: Tensor, max_rows: int,
                 max_tokens: int = 0) -> list[list[int]]:
    """`plan_micro_batches` over a rollout's rows, each as long as its prompt plus its completion."""
    lengths = [len(p) + int(n) for p, n in zip(prompt_ids, completion_mask.sum(dim=1).tolist())]
    return plan_micro_batches(lengths, max_rows, max_tokens)


def pack_micro_batch(prompt_ids: list[list[int]], completion_ids: Tensor, completion_mask: Tensor,
                     rows: list[int], pad_id: int) -> MicroBatch:
    """Rows `rows` as [prompt | completion | pad], trimmed to the longest row."""
    lengths = completion_mask[rows].sum(dim=1).tolist()
    width = max(1, max(lengths))
    total = max(len(prompt_ids[r]) + n for r, n in zip(rows, lengths))
    input_ids = torch.full((len(rows), total), pad_id, dtype=torch.long)
    for i, (r, n) in enumerate(zip(rows, lengths)):
        prompt = prompt_ids[r]
        input_ids[i, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[i, len(prompt): len(prompt) + n] = completion_ids[r, :n].cpu()
    mask = completion_mask[rows, :width].cpu()
    token_rows, token_cols = mask.bool().nonzero(as_tuple=True)
    return MicroBatch(rows=list(rows), input_ids=input_ids, completion_ids=completion_ids[rows, :width].cpu(),
                      completion_mask=mask,
                      prompt_lengths=torch.tensor([len(prompt_ids[r]) for r in rows], dtype=torch.long),
                      row_index=torch.tensor(list(rows), dtype=torch.long), token_rows=token_rows, token_cols=token_cols)


def selected_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, with_entropy: bool = False):
    """log softmax(logits / temperature)[token] for each position, in float32 (and the entropy).

    The plain computation: `logits` `[..., V]`, `tokens` `[...]`. Reference for the chunked path,
    and the path for models that only give logits."""
    if with_entropy:
        logp, entropy, _ = _chunk_forward(logits, tokens, 1.0 / temperature)
        return logp, entropy
    z = logits.float() * (1.0 / temperature)
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1), None


def _chunk_rows(vocab: int) -> int:
    return max(64, CHUNK_BYTES // (4 * vocab))


def _chunk_forward(logits: Tensor, tokens: Tensor, inv_temperature: float):
    """(log π(token), entropy, logsumexp) of one chunk's logits [n, V], in float32."""
    z = logits.float() * inv_temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy, lse


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
    from .models.kernels import triton_allowed

    if triton_allowed(tensor):
        from .triton_logprobs import chunk_logprob_stats

        return chunk_logprob_stats
    return _maybe_compiled("forward", _chunk_forward, tensor)


class _ChunkedLMHead(torch.autograd.Function):
    """(log π(token), entropy) per row of `hidden` [N, H] under the head `weight` [V, H].

    Only N floats per output and the logsumexp are kept; each chunk's logits are recomputed in
    the backward pass (one extra GEMM) instead of being stored."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float, chunk: int,
                with_entropy: bool):
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) gets None, not zeros
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)
        stats = chunk_stats_function(hidden)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            logp[part], entropy[part], lse[part] = stats(hidden[part] @ weight.T, tokens[part], 1.0 / temperature)
        if not with_entropy:
            entropy.zero_()
        ctx.save_for_backward(hidden, weight, tokens, entropy, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, tokens, entropy, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.float()
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            accumulate_chunk_grads(hidden[part] @ weight.T, hidden, weight, tokens[part], lse[part], entropy[part],
                                   grad_logp[part], None if grad_entropy is None else grad_entropy[part],
                                   1.0 / ctx.temperature, part, grad_hidden, grad_weight)
        return grad_hidden, grad_weight, None, None, None, None


def accumulate_chunk_grads(logits: Tensor, hidden: Tensor, weight: Tensor, tokens: Tensor, lse: Tensor,
                           entropy: Tensor, grad_logp: Tensor, grad_entropy: Tensor | None, inv_temperature: float,
                           part: slice, grad_hidden: Tensor | None, grad_weight: Tensor | None) -> None:
    """One chunk's share of ∂loss/∂hidden (written to `grad_hidden[part]`) and of ∂loss/∂W (added to
    `grad_weight`), from its logits [n, V] = hidden[part] Wᵀ and the chunk's tokens, logsumexps,
    entropies and ∂loss/∂log π, ∂loss/∂H (None when the entropy is only logged), each [n]."""
    if grad_entropy is None:  # one term less
        grad_logits = _maybe_compiled("backward_logp", _chunk_backward_logp_only, logits)(
            logits, tokens, lse, grad_logp, inv_temperature)
    else:
        grad_logits = _maybe_compiled("backward", _chunk_backward, logits)(
            logits, tokens, lse, entropy, grad_logp, grad_entropy.float(), inv_temperature)
    if grad_hidden is not None:
        grad_hidden[part] = grad_logits @ weight
    if grad_weight is not None:  # accumulated in the GEMM itself, in the weight's dtype (bf16 on a GPU)
        grad_weight.addmm_(grad_logits.T, hidden[part])


def lm_head_logprobs(hidden: Tensor, weight: Tensor, tokens: Tensor, temperature: float = 1.0,
                     chunk_rows: int | None = None, with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """Chunked (log π(token), entropy), each [N] float32, for hidden states [N, H] and tokens [N]
    (the entropy is zeros unless `with_entropy`)."""
    chunk = chunk_rows or _chunk_rows(weight.shape[0])
    return _ChunkedLMHead.apply(hidden, weight, tokens, float(temperature), int(chunk), bool(with_entropy))


def supports_hidden(model) -> bool:
    """Our CausalLM can return its final hidden states instead of logits."""
    from .models import CausalLM

    return isinstance(model, CausalLM) or isinstance(getattr(model, "module", None), CausalLM)


def _sources(micro: MicroBatch) -> Tensor:
    """[n] column of the hidden state that predicts each completion token: prompt_length − 1 + t."""
    return micro.prompt_lengths[micro.token_rows] - 1 + micro.token_cols


def completion_hidden(model, micro: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Our CausalLM's final hidden states where they predict `micro`'s completion tokens [n, H], its
    LM-head weight [V, H], and those tokens [n], in the order of `token_rows`/`token_cols` (the
    mask's nonzeros, found on the CPU: no sync here). `model` may be a DDP/FSDP wrapper: its
    forward is what is called (the gradient hooks live there); the weight is the wrapped module's."""
    inner = getattr(model, "module", model)
    hidden = model(micro.input_ids, return_hidden=True)
    tokens = micro.completion_ids[micro.token_rows, micro.token_cols]
    return hidden[micro.token_rows, _sources(micro)], inner.lm_head.weight, tokens


def scatter_to_rows(values: Tensor, micro: MicroBatch) -> Tensor:
    """Per-token values [n] back to `micro`'s [b, T] layout, 0 off the mask."""
    out = torch.zeros(micro.completion_mask.shape, dtype=values.dtype, device=values.device)
    return out.index_put((micro.token_rows, micro.token_cols), values)


def micro_batch_logprobs(model, micro: MicroBatch, *, temperature: float = 1.0, with_entropy: bool = False,
                         chunk_rows: int | None = None) -> TokenLogprobs:
    """Log-probs (and entropies) of `micro`'s completion tokens under `model`, [b, T] float32.

    `model` may be a DDP/FSDP wrapper: its forward is what is called (the gradient hooks live
    there); the LM head weight is read from the wrapped module."""
    if supports_hidden(model):
        hidden, weight, tokens = completion_hidden(model, micro)
        token_logp, token_entropy = lm_head_logprobs(hidden, weight, tokens, temperature, chunk_rows, with_entropy)
    else:
        out = model(input_ids=micro.input_ids)
        logits = out if isinstance(out, Tensor) else out.logits
        rows, cols = micro.token_rows, micro.token_cols
        token_logp, token_entropy = selected_logprobs(logits[rows, _sources(micro)], micro.completion_ids[rows, cols],
                                                      temperature, with_entropy)
    logp = scatter_to_rows(token_logp, micro)
    entropy = scatter_to_rows(token_entropy, micro) if with_entropy else None
    return TokenLogprobs(logp, entropy)


def rollout_logprobs(model, prompt_ids: list[list[int]], completion_ids: Tensor, completion_mask: Tensor, *,
                     pad_id: int, max_rows: int, max_tokens: int = 0, temperature: float = 1.0) -> Tensor:
    """[B, T] float32 log-probs of a whole rollout's completions, no gradient (log π_old, log π_ref):
    length-bucketed micro-batches under inference mode, scattered back to rollout order on the
    model's device and copied to the CPU once, at the end (one host sync per pass)."""
    device = next(model.parameters()).device
    full = torch.zeros(completion_ids.shape, dtype=torch.float32, device=device)
    with torch.inference_mode():
        for rows in plan_rollout(prompt_ids, completion_mask, max_rows, max_tokens):
            micro = pack_micro_batch(prompt_ids, completion_ids, completion_mask, rows, pad_id).to(device)
            logp = micro_batch_logprobs(model, micro, temperature=temperature).logp
            full[micro.row_index, : logp.shape[1]] = logp
    return full.cpu()
