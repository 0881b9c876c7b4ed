"""Rollout: prompts in, G completions per prompt out (Algorithm 1's "sample G outputs from π_old").

`sampler.py` is the interface (`Sampler`, `SamplingParams`, `Rollout`) and the Hugging Face
`generate` fallback; the rest of the folder is the fast engine for cohort's own models: its calls and
decode loop (`engine.py`), the checks of a call's inputs (`request_checks.py`), the model's sampling mode and
the KV cache's length and reuse (`engine_setup.py`), KV cache slots (`scheduler.py`), per-sequence state
(`sequence.py`), device-side sampling (`sampling.py`; over vocabulary slices on a tensor-parallel shard,
`token_sampler.py`), CUDA-graph decode (`cuda_graphs.py`) and the overlapped host checks (`overlap.py`).

What a rollout is, once sampled: `Rollout` and the step's `Batch` (`batch.py`), per-row records whose fields
declare their layout (`records.py`), and the `Layout` of the passes over it (`layout.py`).

`make_sampler(model, tokenizer)` makes a sampler for any model: our own `CausalLM` gets the
`Engine`, and so does a transformers model wrapped in `TransformersCausalLM` (cohort_grpo/models/generic.py; its
decode steps run eagerly, without CUDA graphs); any other model gets Hugging Face `generate` (`HFGenerateSampler`). `setup.py` builds a
run's whole rollout side for the trainer (`build_rollouts`: the sampler, the `GroupSampler` stage,
asynchronous rollouts) or a sampling rank's server (`build_rollout_server`), which `sampling_rank.py`
(`SamplingRank`) runs on the ranks that only sample.
"""

from __future__ import annotations

from cohort_grpo.rollout.engine import Engine
from cohort_grpo.models.lora import base_model
from cohort_grpo.rollout.sampler import HFGenerateSampler, Rollout, Sampler, SamplingParams

__all__ = ["Engine", "HFGenerateSampler", "Rollout", "Sampler", "SamplingParams", "engine_samples", "make_sampler"]


def engine_samples(model) -> bool:
    """Whether `make_sampler` gives `model` cohort's engine: it is our `CausalLM` or a transformers model behind
    its interface (`TransformersCausalLM`), also inside a PEFT wrapper."""
    from cohort_grpo.models.generic import TransformersCausalLM
    from cohort_grpo.models.causal_lm import CausalLM

    return isinstance(base_model(model), (CausalLM, TransformersCausalLM))


def make_sampler(model, tokenizer=None, **engine_options) -> Sampler:
    """An `Engine` for cohort's `CausalLM` (also inside a PEFT wrapper), else `HFGenerateSampler`.

    `engine_options` go to `Engine` (max_batch_size, max_seq_len, use_cuda_graph, ...) and are
    ignored by the fallback, which prints one notice line saying it is in use.
    """
    from cohort_grpo.models.generic import TransformersCausalLM

    base = base_model(model)
    if isinstance(base, TransformersCausalLM):  # transformers' modules: graphs checked against an eager step
        engine_options = {"check_graphs": True, **engine_options}
    if engine_samples(model):
        # A PEFT model's LoRA layers live inside the base modules, so sampling the base samples the adapter too.
        return Engine(base, tokenizer, **engine_options)
    print(f"cohort: {type(base).__name__} is not one of cohort's own models; sampling with Hugging Face "
          "generate (slower, no sampling log-probs)")
    return HFGenerateSampler(model, tokenizer)
