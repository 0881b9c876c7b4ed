"""The update: π_θ's gradient over a rollout and the optimizer step (`policy_update.py`), the
micro-batches it is cut into (`packing.py`), per-token log-probs (`logprobs.py`) and the LM head
fused into the loss's gradient (`fused_head.py`, a log-prob backend of `objectives.policy_loss`)."""
