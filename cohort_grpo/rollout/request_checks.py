"""The checks of a request to the `Engine` (engine.py) before it samples anything: the prompts and sampling
settings of a call, `generate_until`'s per-prompt limits, a vision-language call's images and a multi-turn call's
tool turns. Each refusal is a `CohortError` that names the input and the fix.
"""

from __future__ import annotations

from cohort_grpo.errors import CohortError
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.rollout.token_sampler import tensor_parallel_size
from cohort_grpo.rollout.turns import TurnHandler


def check_request(prompt_ids, num_generations: int, params: SamplingParams, tokenizer) -> None:
    """The prompts and sampling settings of a call (`tokenizer`: the engine's, which stop strings need)."""
    if num_generations < 1:
        raise CohortError(f"num_generations={num_generations}: it must be at least 1")
    if not prompt_ids:
        raise CohortError("generate() got no prompts; pass at least one list of token ids")
    if params.max_new_tokens < 1:
        raise CohortError(f"max_new_tokens={params.max_new_tokens}: it must be at least 1")
    if params.temperature < 0:
        raise CohortError(f"temperature={params.temperature}: it must be >= 0 (0 = greedy)")
    if not 0.0 < params.top_p <= 1.0:
        raise CohortError(f"top_p={params.top_p}: it must be in (0, 1]")
    if not 0.0 <= params.min_p < 1.0:
        raise CohortError(f"min_p={params.min_p}: it must be in [0, 1)")
    if params.stop and tokenizer is None:
        raise CohortError("stop strings need a tokenizer: pass tokenizer= to the Engine or drop `stop`")
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise CohortError(f"prompt {i} is empty; every prompt needs at least one token")


def check_limits(prompt_ids: list[list[int]], limits: list[int], params: SamplingParams) -> None:
    """`generate_until`'s limits: one per prompt, each from 1 to `params.max_new_tokens`."""
    if len(limits) != len(prompt_ids) or min(limits, default=0) < 1 or max(limits) > params.max_new_tokens:
        raise CohortError(f"generate_until needs one limit per prompt, from 1 to max_new_tokens="
                          f"{params.max_new_tokens}; got {len(limits)} for {len(prompt_ids)} prompts "
                          f"(from {min(limits, default=0)} to {max(limits, default=0)})")


def check_images(model, images: list | None, prompts: int, turns: TurnHandler | None) -> None:
    """A call's images (None: a text-only call): one entry per prompt, for a model with a vision tower."""
    if images is None:
        return
    if not getattr(model, "takes_images", False):
        raise CohortError(f"images were given to a model without a vision tower ({type(model).__name__}): "
                          "load a vision-language model or drop the images")
    if len(images) != prompts:
        raise CohortError(f"images has {len(images)} entries for {prompts} prompts: pass one per prompt "
                          "(None for a text prompt)")
    if turns is not None:
        raise CohortError("tool turns with images are not supported yet: drop the tools for a vision-language run")
    if tensor_parallel_size(model) > 1:
        raise CohortError("a vision-language model does not sample on a tensor-parallel shard yet: use "
                          "--rollout_tensor_parallel_size 1")


def check_turns(model, turns: TurnHandler | None) -> None:
    """Tool turns (None: a single-turn call) only where the model is not a tensor-parallel shard."""
    # On a shard every rank would run each tool call itself, and when an answer is taken up depends on
    # timing, so the ranks could schedule apart and their collectives stop matching.
    if turns is not None and tensor_parallel_size(model) > 1:
        raise CohortError("multi-turn rollouts (turns=) do not run on a tensor-parallel shard: every rank would "
                          "run the tools; use --rollout_tensor_parallel_size 1 for tool-using rollouts")
