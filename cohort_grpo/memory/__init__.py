"""Memory: `MemoryManager` (`manager.py`) owns every decision about fitting a step in the card —
micro-batch sizes, checkpointed layers, gradients lent the engine's idle KV cache, π_ref's weights
offloaded to the host, the garbage collector's pauses and the out-of-memory policy — the
mixed-precision optimizer (`precision.py`, over the bf16/fp32 bit operations of `bf16.py`), and how many
sampling ranks share one engine so the model and a step's KV cache fit (`sampling_plan.py`), what a
training rank holds in each phase of a step (`training_plan.py`), and the refusal, before the weights load, of
a run that cannot fit its GPUs (`capacity.py`)."""
