"""The sparse mixture-of-experts block of Qwen3-MoE and Mixtral, its routing record, and its checkpoint names.

A token's router logits over E experts go through a softmax; the top k experts process it and their
outputs are summed weighted by their probabilities (renormalised over the k when `norm_topk_prob`),
as in the sparsely-gated MoE layer (Shazeer et al. 2017) and Switch/GShard-style top-k routing. The
experts run as grouped GEMMs (`cohort_grpo/kernels/grouped_mm.py`): the token copies sorted by expert, one
grouped product for gate/up and one for down, whatever the routing; nothing here syncs with the host,
so a decode step stays CUDA-graph capturable.

Routing replay ("R3", as in verl, slime and Megatron-LM): the engine records each token's top-k
expert ids per MoE layer in the KV cache (`KVCache.routes`, by row and position); the trainer's
forwards then route by those ids (`Routing.replay`) while the gate values still come from the
router's softmax, so the router keeps its gradient. Without it, the trainer's own top-k may pick
other experts than the sampler did wherever two router logits nearly tie, and π_θ stops being the
policy that sampled.

Parameters (`mlp.gate.weight` [E, H], `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) are named as transformers 5 holds them for both families; checkpoints store one matrix per expert,
Qwen3-MoE's as `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, Mixtral's as
`block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down) beside `block_sparse_moe.gate.weight`;
`fuse_expert_weights` reads either by name, `split_expert_weights` writes the family's own.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from cohort_grpo.kernels.expert_order import expert_order
from cohort_grpo.kernels.grouped_mm import decode_sized, grouped_linear

ROUTE_DTYPE = torch.int16  # expert ids as recorded; 32767 experts is more than any model has
_PER_EXPERT = re.compile(
    r"^(.*)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(.*)\.block_sparse_moe\.gate\.weight$")
# A checkpoint's names for one MoE block, per family: (block, gate, up, down); `mlp` is the block in memory.
CHECKPOINT_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                           "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
# Mixtral's projection names -> ours (Qwen3-MoE's), from the table above
_PROJECTION = dict(zip(CHECKPOINT_EXPERT_NAMES["mixtral"][1:], CHECKPOINT_EXPERT_NAMES["qwen3_moe"][1:]))


class Routing:
    """What one forward's MoE layers read and report. `recorded` [B, T, MoE layers, k]: the expert ids the
    sampler chose for each input token; with `replay` the layers route by them, else by the router's own
    top-k. Filled by the forward: `free_differs` [B, T] (given `recorded`: whether the router's own top-k
    differs from the recorded ids in any layer), and, when `keep_router` is set, per MoE layer the router's
    softmax `router_probs` [B·T, E] and the ids routed by `expert_ids` [B·T, k].

    A plain class, not a dataclass: FSDP2's mixed precision rebuilds a dataclass passed to a forward (to cast
    its tensors), and the layers would then write their reports into the copy."""

    def __init__(self, recorded: torch.Tensor | None = None, replay: bool = True, keep_router: bool = False):
        self.recorded, self.replay, self.keep_router = recorded, replay, keep_router
        self.free_differs: torch.Tensor | None = None
        self.router_probs: list[torch.Tensor] = []
        self.expert_ids: list[torch.Tensor] = []

    def to(self, device) -> "Routing":
        """A fresh record (nothing reported yet) with `recorded` on `device`."""
        recorded = None if self.recorded is None else self.recorded.to(device, non_blocking=True)
        return Routing(recorded, self.replay, self.keep_router)

    def for_layer(self, moe_index: int) -> "LayerRouting":
        """What the MoE layer `moe_index` reads: its slice of `recorded`, and a fresh place for its report."""
        recorded = None if self.recorded is None else self.recorded[..., moe_index, :]
        return LayerRouting(recorded, self.replay, self.keep_router)

    def add(self, layer: "LayerRouting") -> None:
        """Take in what one MoE layer reported (`for_layer`'s record after the layer ran), in layer order."""
        if layer.free_differs is not None:
            self.free_differs = layer.free_differs if self.free_differs is None else self.free_differs | layer.free_differs
        if layer.router_probs is not None:
            self.router_probs.append(layer.router_probs)
            self.expert_ids.append(layer.expert_ids)


class LayerRouting:
    """One MoE layer's part of a `Routing`: its `recorded` ids [B, T, k] and what it reports (`free_differs`
    [B, T]; with `keep_router`, `router_probs` [B·T, E] and the `expert_ids` [B·T, k] routed by). The layer
    sets the reports as attributes of a record made fresh for each call, so the same compiled graph serves
    every MoE layer (no layer index or list length to guard on) and a checkpointed layer's recomputation
    writes the same values again. A plain class for the reason `Routing` is one."""

    def __init__(self, recorded: torch.Tensor | None = None, replay: bool = True, keep_router: bool = False):
        self.recorded, self.replay, self.keep_router = recorded, replay, keep_router
        self.free_differs: torch.Tensor | None = None
        self.router_probs: torch.Tensor | None = None
        self.expert_ids: torch.Tensor | None = None


class Experts(nn.Module):
    """E SwiGLU experts as stacked matrices: gate and up side by side [E, 2I, H], down [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, inner: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [n, H] sorted by expert, `offsets` [E] their cumulative ends -> [n, H]."""
        gate, up = grouped_linear(x, self.gate_up_proj, offsets).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, self.down_proj, offsets)


class SparseMoeBlock(nn.Module):
    """Router → softmax → top-k → (renormalise) → grouped-GEMM experts → weighted sum (Qwen3-MoE, Mixtral)."""

    def __init__(self, config, moe_index: int):
        super().__init__()
        self.moe_index = moe_index  # this block's place among the MoE layers (the routes' layer axis)
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.experts.active_share = self.top_k / config.num_experts  # of the tokens, each expert weight sees

    def forward(self, x: torch.Tensor, routing: LayerRouting | None = None, kv_cache=None, cache_rows=None,
                position_ids=None, write_mask=None, **_unused) -> torch.Tensor:
        batch, length, hidden = x.shape
        flat = x.reshape(-1, hidden)
        probs = torch.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        free_weights, free_ids = torch.topk(probs, self.top_k, dim=-1)
        ids, weights = free_ids, free_weights
        if routing is not None and routing.recorded is not None:
            recorded = routing.recorded.reshape(-1, self.top_k).long()
            routing.free_differs = (free_ids.sort(-1).values != recorded.sort(-1).values).any(-1).reshape(batch, length)
            if routing.replay:  # the sampler's experts, weighted by this router's probabilities (its gradient)
                ids, weights = recorded, probs.gather(1, recorded)
        if routing is not None and routing.keep_router:
            routing.router_probs, routing.expert_ids = probs, ids
        if kv_cache is not None and kv_cache.routes is not None:
            kv_cache.write_routes(self.moe_index, cache_rows, position_ids, ids.reshape(batch, length, -1), write_mask)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = self.expert_outputs(flat, ids, weights.to(x.dtype))
        return out.reshape(batch, length, hidden)

    def expert_outputs(self, flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[t, j] · expert_{ids[t, j]}(flat[t]) for each token t: its k copies sorted by expert
        (stable, so equal experts keep token order), the experts' grouped products, the copies put back
        in (token, j) order and summed over j (a fixed order: no atomics)."""
        num_experts = self.gate.out_features
        if decode_sized(flat, ids.numel(), num_experts):
            # a decode step: the same order and ends in one launch instead of about six (expert_order.py)
            order, tokens, offsets = expert_order(ids, num_experts, self.top_k)
        else:
            # 16-bit keys: the sort's radix passes follow the width of its keys
            flat_ids = ids.reshape(-1).to(torch.int16 if num_experts <= 2**15 else torch.int32)
            order = torch.argsort(flat_ids, stable=True)
            tokens = order // self.top_k
            # cumulative ends of each expert's copies, found on the device (no bincount: it syncs for its size)
            offsets = torch.searchsorted(flat_ids[order],
                                         torch.arange(num_experts, device=ids.device, dtype=flat_ids.dtype),
                                         right=True).to(torch.int32)
        outputs = self.experts(flat[tokens], offsets)
        unsorted = torch.empty_like(outputs).index_copy_(0, order, outputs)
        return (unsorted.reshape(-1, self.top_k, flat.shape[-1]) * weights[..., None]).sum(1)


def active_shares(model: nn.Module) -> dict[int, float]:
    """id(parameter) -> the share of the tokens it sees, for each expert weight of `model`'s mixtures of
    experts (k / E: `Experts.active_share`); a parameter not listed sees every token."""
    return {id(p): m.active_share for m in model.modules() if hasattr(m, "active_share") for p in m.parameters()}


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4): E · Σ_e f_e · P_e, f_e the share of
    the token copies sent to expert e (no gradient) and P_e its mean router probability."""
    share = torch.zeros(num_experts, device=probs.device).index_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), device=probs.device)) / max(ids.numel(), 1)
    return num_experts * (share * probs.float().mean(0)).sum()


def expert_load_max_over_mean(routes: torch.Tensor, mask: torch.Tensor, num_experts: int) -> float:
    """Routed token copies of the busiest expert over the mean per expert, averaged over MoE layers, for
    `routes` [B, T, layers, k] restricted to `mask` [B, T] (1 = counted). 1.0 is perfectly balanced."""
    chosen = routes[mask.bool()].long()  # [n, layers, k]
    if chosen.numel() == 0:
        return 0.0
    layers = chosen.shape[1]
    counts = torch.zeros(layers, num_experts).scatter_add_(
        1, chosen.permute(1, 0, 2).reshape(layers, -1), torch.ones(layers, chosen.shape[0] * chosen.shape[2]))
    return float((counts.max(1).values / counts.mean(1)).mean())


def fuse_expert_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names → ours: per-expert `experts.{e}.gate_proj/up_proj/down_proj.weight` (Mixtral's
    `block_sparse_moe.experts.{e}.w1/w3/w2.weight`) stacked into `mlp.experts.gate_up_proj` [E, 2I, H] and
    `mlp.experts.down_proj` [E, H, I], Mixtral's router renamed to `mlp.gate.weight`. Already-stacked names
    pass as they are; an expert missing from the sequence 0..E-1 leaves its block unconverted (the loader's
    missing/unexpected check then names it)."""
    per_block: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    original: dict[tuple[str, str, int], str] = {}  # (block, kind, expert) -> the checkpoint's name
    out = {}
    for name, tensor in state.items():
        match, router = _PER_EXPERT.match(name), _MIXTRAL_ROUTER.match(name)
        if router is not None:
            out[f"{router.group(1)}.mlp.gate.weight"] = tensor
            continue
        if match is None:
            out[name] = tensor
            continue
        prefix, expert = f"{match.group(1)}.mlp.experts", int(match.group(3))
        kind = _PROJECTION.get(match.group(4), match.group(4))
        per_block.setdefault(prefix, {}).setdefault(kind, {})[expert] = tensor
        original[prefix, kind, expert] = name
    for prefix, kinds in per_block.items():
        counts = {kind: len(experts) for kind, experts in kinds.items()}
        complete = (set(kinds) == {"gate_proj", "up_proj", "down_proj"} and len(set(counts.values())) == 1
                    and all(set(experts) == set(range(len(experts))) for experts in kinds.values()))
        if not complete:
            out.update({original[prefix, kind, e]: t for kind, experts in kinds.items() for e, t in experts.items()})
            continue
        experts = range(counts["down_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in experts])
        out[f"{prefix}.down_proj"] = torch.stack([kinds["down_proj"][e] for e in experts])
    return out


def split_expert_weights(state: dict[str, torch.Tensor], model_type: str = "qwen3_moe") -> dict[str, torch.Tensor]:
    """Ours → the checkpoint names of `model_type`'s family (what transformers writes and hub checkpoints
    hold): one matrix per expert, under `CHECKPOINT_EXPERT_NAMES[model_type]`."""
    block, gate_name, up_name, down_name = CHECKPOINT_EXPERT_NAMES[model_type]
    out = {}
    for name, tensor in state.items():
        layer = name.rsplit(".mlp.", 1)[0]
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{gate_name}.weight"] = gate[e]
                out[f"{layer}.{block}.experts.{e}.{up_name}.weight"] = up[e]
        elif name.endswith(".mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{layer}.{block}.experts.{e}.{down_name}.weight"] = tensor[e]
        elif name.endswith(".mlp.gate.weight") and block != "mlp":
            out[f"{layer}.{block}.gate.weight"] = tensor
        else:
            out[name] = tensor
    return out
