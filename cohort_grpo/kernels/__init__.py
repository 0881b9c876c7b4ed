"""Kernels: all of cohort's Triton and torch.compile code, in one folder.

Every kernel is optional: each has a plain-torch definition (`*_plain` / `*_reference` here, or the
caller's own code) that runs on the CPU and without triton, and that the tests hold the kernel to.

- `triton_common.py`: what the Triton kernels share (the optional `triton` import, the `jit`
  decorator, the combine functions of their reductions).
- `decode_attention.py`: split-K flash-decoding attention for one decode step (`CausalLM`'s
  attention with a KV cache).
- `sampling.py`: the engine's default sampling step (temperature, Gumbel-max) in one Triton pass
  (`cohort_grpo.rollout.sampling`).
- `logprobs.py`: log π(token), entropy and log-sum-exp of an LM-head chunk's logits in one Triton
  pass (`cohort_grpo.update.logprobs`).
- `elementwise.py`: the decoder's elementwise pieces (RMSNorm, rotary, SwiGLU, residual add) as
  torch.compile'd fused functions for the decode step, and the switches that turn kernels on.
- `training_compile.py`: torch.compile of one decoder layer for the training forward and backward.
- `exact_matmul.py`, `exact_rms_norm.py`, `exact_attention.py`, `exact_elementwise.py`: the batch-invariant
  matrix product, RMSNorm, causal attention (decode and full forward alike), rotary and SwiGLU of
  `rollout_numerics="exact"`
  (cohort_grpo/models/exact_layers.py), whose sampler and trainer log-probs are equal bit for bit.
- `grouped_mm.py`: a mixture of experts' grouped GEMMs (torch's native grouped mm with a grouped backward,
  a padded batched product where it does not serve), tested against a loop over experts;
  `thin_grouped_mm.py`: the same product for a decode step's few rows an expert, one Triton kernel;
  `expert_order.py`: a decode step's token copies ordered by expert (a stable counting sort), one launch.
"""
