"""What the update reads from a mixture-of-experts forward: the replay mismatch, the load-balancing loss, the
experts' load (cohort_grpo/models/moe.py routes; the metrics are named in docs/reference.md)."""

from __future__ import annotations

import torch

from cohort_grpo.models.moe import expert_load_max_over_mean, load_balancing_loss
from cohort_grpo.update.packing import MicroBatch


def num_experts(model) -> int:
    """The experts per MoE layer of our model (inside a DDP/FSDP or PEFT wrapper); 0 for a dense model."""
    from cohort_grpo.models.generic import TransformersCausalLM
    from cohort_grpo.models.lora import base_model

    base = base_model(getattr(model, "module", model))
    if isinstance(base, TransformersCausalLM):  # transformers' MoE blocks record no routes to replay or report
        return 0
    return int(getattr(base.config, "num_experts", 0) or 0)


def replay_mismatch(micro: MicroBatch) -> torch.Tensor | None:
    """The share of `micro`'s predicting positions (each completion token's previous position: the prompt's
    last token, then every completion token but the last, the positions the sampler fed forward) whose
    router, left free, picks other top-k experts than the sampler did in at least one MoE layer. None
    without recorded routes."""
    routing = micro.routing
    if routing is None or routing.free_differs is None:
        return None
    return routing.free_differs[micro.source_rows, micro.source_cols].float().mean()


def router_aux_loss(micro: MicroBatch, num_experts: int) -> torch.Tensor:
    """The Switch load-balancing loss of `micro`'s forward, averaged over MoE layers (over every input token:
    the router sees prompts too)."""
    routing = micro.routing
    losses = [load_balancing_loss(p, i, num_experts) for p, i in zip(routing.router_probs, routing.expert_ids)]
    return torch.stack(losses).mean()


def expert_load(rollout, prompt_lengths: list[int], num_experts: int) -> float | None:
    """`expert_load_max_over_mean` of the sampler's routes over every position it fed forward (each row's
    prompt and its completion but the last token); None without routes."""
    routes = rollout.routed_experts
    if routes is None:
        return None
    ends = torch.tensor(prompt_lengths) + rollout.completion_mask.sum(1) - 1
    fed = torch.arange(routes.shape[1])[None, :] < ends[:, None]
    return expert_load_max_over_mean(routes, fed, num_experts)
