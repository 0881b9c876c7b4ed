"""One rank's shard of the decoder for tensor-parallel inference (Megatron-LM; Shoeybi et al. 2019).

A model too large, or a decode step too slow, for one GPU is split over T ranks of a process group:
every rank runs every layer on all tokens, but holds 1/T of each weight matrix and computes 1/T of
each layer's work. The split follows Megatron-LM, which needs two all-reduces per decoder layer:

- Attention is split by head. Rank r owns query heads [r·H/T, (r+1)·H/T) and KV heads
  [r·H_kv/T, (r+1)·H_kv/T): the rows of q/k/v_proj (and of Qwen2's q/k/v biases) that produce them.
  Grouped-query attention stays within a rank, since T divides H_kv and query head h reads KV head
  h // (H / H_kv). Its KV cache holds only its own KV heads. Qwen3's q/k norms normalise each head
  with one head_dim-sized weight shared by all heads: every rank keeps the whole weight.
  o_proj is split by its input columns (row-parallel): each rank's product is a partial sum of the
  output, summed by one all-reduce; a bias is added once, after it.
- The SwiGLU MLP is split the same way: gate/up by output rows (column-parallel; the gate's
  elementwise product needs no communication), down_proj by input columns, then one all-reduce.
- A mixture of experts (Qwen3-MoE, Mixtral) splits every expert the way the MLP is split: each rank holds
  the columns [r·I/T, (r+1)·I/T) of every expert's gate and up projections (two row ranges of the stacked
  `gate_up_proj` [E, 2I, H], gate rows then up rows) and those input columns of its `down_proj` [E, H, I];
  the router is replicated. Every rank routes the same all-reduced hidden state with the same router, so
  all pick the same experts (and record the same routes), run their slice of each chosen expert, and one
  all-reduce after the weighted sum adds the slices. A decode step then reads 1/T of every expert it touches.
- The vocabulary is split into T contiguous slices, of ceil(V/T) rows each: the embedding looks up
  the ids of its slice (zeros for the others) and an all-reduce sums the slices; the LM head returns
  this rank's slice of the logits, `[..., ceil(V/T)]`, never the full `[..., V]` (a vocabulary-
  parallel sampler reduces over ranks instead; `gather_logits` assembles the full logits, for tests).
  A vocabulary T does not divide is padded to T·ceil(V/T): padded rows embed nothing real and their
  logits are -inf, so a softmax or an argmax over the ranks never picks them. Tied embeddings stay
  tied: the embedding and the head own the same slice.

A shard is a `CausalLM` built from a config with H/T heads, H_kv/T KV heads, I/T MLP columns and
ceil(V/T) tokens (and I_experts/T expert columns), whose o_proj, down_proj, MoE blocks, embedding and head
are replaced by the subclasses below:
the decoder's code, its KV-cache path (prefill, then decode steps) and `KVCache.for_model` serve it
unchanged. It is for inference: its parameters do not require gradients, and the all-reduces are
not differentiable. After each update, cohort_grpo/models/resharding.py copies the trainer's new weights
into the shard in place (`rank_slice` defines each rank's part of a weight, for both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cohort_grpo.errors import CohortError
from cohort_grpo.models.config import ModelConfig
from cohort_grpo.models.lora import has_lora
from cohort_grpo.models.causal_lm import CausalLM
from cohort_grpo.models.moe import SparseMoeBlock

# Weights split by output rows (their biases too) and by input columns; the rest is replicated.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# A mixture of experts' stacked matrices: gate/up [E, 2I, H] split by its two row ranges, down [E, H, I] by columns.
EXPERTS_GATE_UP, EXPERTS_DOWN = "experts.gate_up_proj", "experts.down_proj"
VOCABULARY_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
SIZE_OPTION = "--rollout_tensor_parallel_size"


def check_tensor_parallel_size(config: ModelConfig, size: int, group_size: int | None = None) -> None:
    """Refuse, as one CohortError line naming the numbers, a T that cannot split `config` over a group
    of `group_size` ranks: T must divide the query heads, the KV heads and the MLP width, and the
    group must have exactly T ranks. (The vocabulary is padded, so any T splits it.)"""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise CohortError(f"{SIZE_OPTION} {size!r} is not a positive whole number; choose 1 or more")
    widths = [(config.num_attention_heads, "attention heads"), (config.num_key_value_heads, "KV heads")]
    if len(config.sparse_layers) < config.num_hidden_layers:  # some layer has a dense MLP
        widths.append((config.intermediate_size, "MLP columns (intermediate_size)"))
    if config.num_experts:
        widths.append((config.moe_intermediate_size, "expert columns (moe_intermediate_size)"))
    for count, what in widths:
        if count % size:
            raise CohortError(f"{SIZE_OPTION} {size} does not divide the model's {count} {what}; "
                              f"choose a {SIZE_OPTION} that divides {count}")
    if group_size is None or size == 1:
        return
    if size > group_size:
        raise CohortError(f"{SIZE_OPTION} {size} is more than the {group_size} rank(s) of its process group; "
                          f"choose at most {group_size}, or start {size} processes (torchrun)")
    if size < group_size:
        raise CohortError(f"{SIZE_OPTION} {size} splits the model over {size} ranks, but its process group has "
                          f"{group_size}; pass a group of {size} ranks (torch.distributed.new_subgroups)")


def lora_split_refusal(size: int) -> CohortError:
    """The refusal of LoRA adapters split over `size` sampling ranks (also raised from the options alone, before
    any rank starts: cohort_grpo.parallel.placement)."""
    return CohortError(f"rollout_tensor_parallel_size={size} with LoRA adapters is not supported (their layers are "
                       "not split); use --rollout_tensor_parallel_size 1 (LoRA's memory need is the base model's, "
                       "bf16) or train the full model")


def tools_split_refusal(size: int) -> CohortError:
    """The refusal of tool turns sampled by a group of `size` ranks (also raised from the options alone, before any
    rank starts: cohort_grpo.cli.launch)."""
    return CohortError(f"rollout_tensor_parallel_size={size} with tools is not supported (every rank of a sampling "
                       "group would run each tool call); use --rollout_tensor_parallel_size 1")


def check_splittable(model, size: int, tools: bool) -> None:
    """Refuse, in one line, a split of `model` into `size` ranks for sampling that cannot work: a model cohort
    does not implement itself (sampled through Hugging Face `generate`), LoRA adapters (peft's wrappers are not
    split) and tool turns (every rank of a group would run each tool call)."""
    if not isinstance(model, CausalLM):
        raise CohortError(f"rollout_tensor_parallel_size={size} needs a model cohort implements itself (Llama, "
                          f"Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral); {type(model).__name__} is sampled through "
                          "Hugging Face generate: use --rollout_tensor_parallel_size 1")
    if has_lora(model):
        raise lora_split_refusal(size)
    if tools:
        raise tools_split_refusal(size)


def local_vocab_size(vocab_size: int, size: int) -> int:
    """Rows of each rank's vocabulary slice: ceil(V / T) (the last slice padded)."""
    return -(-vocab_size // size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's shard: H/T heads, H_kv/T KV heads, I/T MLP and expert columns, ceil(V/T) tokens
    (hidden size and head_dim unchanged, so attention scales and RoPE are those of the full model)."""
    check_tensor_parallel_size(config, size)
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size, intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size, vocab_size=local_vocab_size(config.vocab_size, size),
        extra=dict(config.extra))


def rank_slice(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """The part of the full model's tensor `name` that rank `rank` of a `size`-way split holds, as a view
    of `tensor` (no copy). The one definition of the Megatron-LM split (Shoeybi et al. 2019) that
    `shard_state_dict` and the in-place updates of cohort_grpo/models/resharding.py share:

    - q/k/v, gate/up (weights and biases): output rows [r·n/T, (r+1)·n/T) (heads, MLP columns);
    - o_proj, down_proj weights: those input columns (their biases are added once, whole);
    - a mixture of experts' `experts.gate_up_proj` [E, 2I, H]: the gate rows [r·I/T, (r+1)·I/T) and the same
      rows of the up half, as a view [E, 2, I/T, H] (the shard holds it flattened, [E, 2I/T, H]);
      `experts.down_proj` [E, H, I]: those input columns; the router whole;
    - embedding and LM head: the real rows of vocabulary slice r, [r·ceil(V/T), (r+1)·ceil(V/T)) cut at V,
      so the last slices may have fewer rows than the shard (which pads them), or none;
    - everything else (norms, Qwen3's per-head q/k norms, row-parallel biases): the whole tensor.

    A tensor that cannot be split so (rows that are not the vocabulary's, a dimension T does not divide)
    is refused with one CohortError line naming it."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if name.endswith(EXPERTS_GATE_UP):  # [E, 2I, H] -> [E, 2, I/T, H]: rank r's gate rows and its up rows
        if tensor.dim() != 3 or tensor.shape[1] % (2 * size):
            raise CohortError(f"{name} has shape {tuple(tensor.shape)}, whose gate and up halves {size} ranks cannot "
                              "split; pass the weights of the model the shard was built from")
        width = tensor.shape[1] // (2 * size)
        return tensor.unflatten(1, (2, tensor.shape[1] // 2)).narrow(2, rank * width, width)
    if name in VOCABULARY_PARALLEL:
        if tensor.dim() != 2 or tensor.shape[0] != config.vocab_size:
            raise CohortError(f"{name} has shape {tuple(tensor.shape)}, but the model has {config.vocab_size} "
                              "vocabulary rows; pass the weights of the model the shard was built from")
        rows = local_vocab_size(config.vocab_size, size)
        start = min(rank * rows, config.vocab_size)
        return tensor[start: min(start + rows, config.vocab_size)]
    if name.endswith(EXPERTS_DOWN):  # [E, H, I]: each expert's input columns
        dim = 2
    elif module in COLUMN_PARALLEL:
        dim = 0
    elif module in ROW_PARALLEL and name.endswith(".weight"):
        dim = 1
    else:
        return tensor
    if tensor.dim() <= dim or tensor.shape[dim] % size:
        raise CohortError(f"{name} has shape {tuple(tensor.shape)}, which {size} ranks cannot split along "
                          f"dimension {dim}; pass the weights of the model the shard was built from")
    width = tensor.shape[dim] // size
    return tensor.narrow(dim, rank * width, width)


def shard_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig, rank: int,
                     size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices (`rank_slice`) of a full `CausalLM` state dict (same names, each tensor a
    copy, so the full tensors can be freed; vocabulary slices padded with zero rows to ceil(V/T)). A tied
    checkpoint may lack lm_head.weight."""
    check_tensor_parallel_size(config, size)
    rows = local_vocab_size(config.vocab_size, size)
    shard = {}
    for name, tensor in state.items():
        piece = rank_slice(name, tensor, config, rank, size)
        if name in VOCABULARY_PARALLEL and piece.shape[0] < rows:
            piece = torch.cat([piece, piece.new_zeros(rows - piece.shape[0], *piece.shape[1:])])
        shard[name] = piece.detach().clone(memory_format=torch.contiguous_format)
        if name.endswith(EXPERTS_GATE_UP):  # [E, 2, I/T, H] -> [E, 2I/T, H]: gate rows, then up rows
            shard[name] = shard[name].flatten(1, 2)
    return shard


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum `tensor` over `group` in place (nothing to do without one: a single-rank shard)."""
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r · W_r^T) + b: this rank's input columns of a linear layer, the ranks' partial
    products summed by one all-reduce, the bias added once after it (not once per rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group):
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_sum(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class RowParallelSparseMoeBlock(SparseMoeBlock):
    """A mixture of experts whose experts hold this rank's columns: every rank routes alike (the same router on
    the same hidden state), each sums its experts' partial outputs with the routing weights, and one
    all-reduce adds the ranks' sums (the weighted sum is linear in each expert's down_proj output)."""

    def __init__(self, config, moe_index: int, group):
        super().__init__(config, moe_index)
        self.group = group

    def expert_outputs(self, flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(super().expert_outputs(flat, ids, weights), self.group)


class VocabParallelEmbedding(nn.Embedding):
    """The rows of token ids [vocab_start, vocab_start + num_embeddings): ids of other slices embed
    to zero here, and the all-reduce adds the one rank's row that owns each id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int, group):
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_sum(hidden.masked_fill(outside[..., None], 0.0), self.group)


class VocabParallelHead(nn.Linear):
    """This rank's slice of the logits; columns past the real vocabulary (the padding of the last
    slices) are -inf, so they take no probability and are never sampled."""

    def __init__(self, in_features: int, out_features: int, real_columns: int):
        super().__init__(in_features, out_features, bias=False)
        self.real_columns = real_columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.real_columns < self.out_features:
            logits[..., self.real_columns:] = float("-inf")
        return logits


class TensorParallelCausalLM(CausalLM):
    """Rank `rank` of a `size`-way tensor-parallel split of a model of `full_config` (see the module
    docstring); its forward returns this rank's vocabulary slice of the logits. `config` is the
    shard's (its head counts size KVCache.for_model per rank); `full_config` the whole model's."""

    def __init__(self, full_config: ModelConfig, rank: int, size: int, group=None):
        super().__init__(shard_config(full_config, size))
        self.full_config = full_config
        self.tensor_parallel_rank, self.tensor_parallel_size, self.group = rank, size, group
        config = self.config
        hidden, rows = config.hidden_size, config.vocab_size
        self.vocab_start = rank * rows
        self.vocab_stop = min(self.vocab_start + rows, full_config.vocab_size)  # the real ids end here
        self.model.embed_tokens = VocabParallelEmbedding(rows, hidden, self.vocab_start, group)
        self.lm_head = VocabParallelHead(hidden, rows, max(0, self.vocab_stop - self.vocab_start))
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            attention.o_proj = RowParallelLinear(attention.o_proj.in_features, hidden, config.o_bias, group)
            if layer.sparse:
                layer.mlp = RowParallelSparseMoeBlock(config, mlp.moe_index, group)
            else:
                mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, hidden, config.mlp_bias, group)
        self.tie_weights()

    def save_pretrained(self, out_dir, state: dict | None = None):
        raise CohortError("a tensor-parallel shard holds 1/T of the model and cannot be saved as one; "
                          "save the full model it was split from")


def process_group_rank_size(group) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); (0, 1) when torch.distributed is not started."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def load_shard(config: ModelConfig, state: Mapping[str, torch.Tensor], group=None, size: int | None = None,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> TensorParallelCausalLM:
    """This rank's shard of the model `config` with full weights `state`, split over `group` (default:
    the whole world) into `size` ranks (default: the group's size), in eval mode, on `device` and in
    `dtype` (default: those of `state`). Every rank of the group calls it; none communicates here."""
    rank, group_size = process_group_rank_size(group)
    size = group_size if size is None else size
    check_tensor_parallel_size(config, size, group_size)
    if size == 1:  # one rank holds everything: nothing to split, nothing to communicate
        rank, group = 0, None
    elif group is None:
        group = dist.group.WORLD
    first = next(iter(state.values()))
    device, dtype = torch.device(device or first.device), dtype or first.dtype
    pieces = shard_state_dict(state, config, rank, size)
    if config.tie_word_embeddings:
        pieces.pop("lm_head.weight", None)
    with torch.device("meta"):  # no random init of weights about to be replaced
        shard = TensorParallelCausalLM(config, rank, size, group)
    missing, unexpected = shard.load_state_dict(pieces, strict=False, assign=True)
    missing = sorted(set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if missing or unexpected:
        raise CohortError(f"the weights to split do not fit a {config.model_type} model of this config "
                          f"(missing {missing[:3]}, unexpected {sorted(unexpected)[:3]}); pass the full model's state dict")
    shard.tie_weights()  # assign=True gave the embedding a new tensor: the head must share it again
    shard.requires_grad_(False)
    return shard.to(device=device, dtype=dtype).eval()


def shard_model(model: CausalLM, group=None, size: int | None = None) -> TensorParallelCausalLM:
    """This rank's shard of `model` (a full `CausalLM`, left as it is), on its device and in its dtype."""
    return load_shard(model.config, model.state_dict(), group, size, model.device, model.dtype)


def gather_logits(local_logits: torch.Tensor, group=None, vocab_size: int | None = None) -> torch.Tensor:
    """The full logits `[..., V]` from every rank's slice (an all-gather; padding cut at `vocab_size`).
    For tests and checks only: the sampler works on the slices."""
    _, size = process_group_rank_size(group)
    pieces = [local_logits]
    if size > 1:
        pieces = [torch.empty_like(local_logits) for _ in range(size)]
        dist.all_gather(pieces, local_logits.contiguous(), group=group)
    full = torch.cat(pieces, dim=-1)
    return full if vocab_size is None else full[..., :vocab_size]
