"""`--gradient_checkpointing_layers auto`: checkpoint (recompute) only as many decoder layers as a memory budget needs.

One vocabulary throughout: a *checkpointed* layer drops its activations after the forward and
recomputes them in the backward; the others keep them. `gradient_checkpointing_layers` (the option),
`CausalLM.checkpointed_layers` and the `checkpointed_layers` metric all count the checkpointed ones.

Recomputing a layer in the backward costs one more forward of it and saves what the layer would keep
for its backward.
Which layers to recompute therefore depends on the card, the model and the micro-batch. `auto`
measures instead of asking:

1. The first update recomputes every layer but the last, and `ActivationProbe` measures what that
   last layer keeps: the memory allocated across its forward, less its output (which the next
   layer's checkpoint would hold anyway), per token.
2. Before the second update, `layers_to_keep` turns the first update's peak and that cost, with
   what grows with the micro-batch scaled to the largest one the run can make (a GSM8K run's first
   update may see only short completions), into the number of layers that fit under the
   budget (`--max_memory_gib`, default 90% of the card). The first layers are the checkpointed ones
   (`CausalLM.checkpointed_layers`).
3. An update that still runs out of memory checkpoints every layer again before the micro-batch
   halves (`MemoryManager.run`, cohort_grpo/memory/manager.py).

Cohort's own models and the generic path's (`TransformersCausalLM`) on a GPU only; elsewhere (CPU, or no allocator to ask) every layer is recomputed.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.lora import base_model
from cohort_grpo.models import CausalLM
from cohort_grpo.models.generic import TransformersCausalLM

BUDGET_SHARE = 0.9  # of the card's memory, when --max_memory_gib is 0


def layers_to_keep(num_layers: int, update_peak: float, kept: int, kept_bytes_per_token: float,
                   tokens_measured: int, max_tokens: int, budget: float, boundary_bytes_per_token: float = 0.0) -> int:
    """How many layers may keep their activations, from one update that kept `kept` of them.

    That update peaked at `update_peak` bytes with micro-batches of at most `tokens_measured`
    tokens; a kept layer costs `kept_bytes_per_token` for each token of a micro-batch, and the
    largest micro-batch of the run has `max_tokens`. What grows with the micro-batch is scaled to
    `max_tokens` first: the hidden state every layer boundary holds for the backward
    (`boundary_bytes_per_token` a layer: a checkpoint's input, or a kept layer's), the kept layers'
    activations, and one more layer's worth for the recomputation and gradients in flight. Then each
    further layer costs `kept_bytes_per_token × max_tokens`.

    Worked example, the 1.5B shape at 32-row micro-batches of 16,896 tokens: the first update keeps
    1 layer and peaks at 29.5 GiB; a kept layer holds 75 KB a token, 1.18 GiB a micro-batch.
    Under a 36.0 GiB budget: 1 + ⌊(36.0 − 29.5) / 1.18⌋ = 6 layers keep their activations.
    Had that update seen micro-batches of only 8,448 tokens, the 8,448 tokens still to come would
    add 28 boundaries × 3 KB (hidden 1536 in bf16) + 2 × 75 KB a token, 1.86 GiB, before the
    first further layer: 1 + ⌊(36.0 − 29.5 − 1.86) / 1.18⌋ = 4.
    """
    per_layer = kept_bytes_per_token * max_tokens
    if per_layer <= 0:
        return num_layers
    growing_per_token = num_layers * boundary_bytes_per_token + (kept + 1) * kept_bytes_per_token
    peak_at_max = update_peak + growing_per_token * max(0, max_tokens - tokens_measured)
    keep = kept + math.floor((budget - peak_at_max) / per_layer)
    return max(0, min(num_layers, keep))


class ActivationProbe:
    """What one kept decoder layer's forward leaves allocated for its backward, per token.

    `CausalLM.forward` calls `around` for its first kept layer while the probe is attached
    (`model.activation_probe`). `allocated` reads the device allocator's count of bytes in use."""

    def __init__(self, allocated: Callable[[], int]):
        self.allocated = allocated
        self.bytes_per_token = 0.0
        self.tokens = 0  # the largest micro-batch measured

    def around(self, forward: Callable[[], torch.Tensor], tokens: int) -> torch.Tensor:
        before = self.allocated()
        out = forward()
        self.record(self.allocated() - before, out, tokens)
        return out

    def record(self, allocated: int, out: torch.Tensor, tokens: int) -> None:
        """One forward of the layer left `allocated` more bytes in use, `out` (its output) among them."""
        kept = allocated - out.numel() * out.element_size()
        self.bytes_per_token = max(self.bytes_per_token, kept / max(tokens, 1))
        self.tokens = max(self.tokens, tokens)


class AutoCheckpointing:
    """`gradient_checkpointing_layers=auto`: measure in the first update, decide before the second."""

    def __init__(self, model, num_layers: int, budget: float, allocated: Callable[[], int],
                 peak: Callable[[], int], reset_peak: Callable[[], None] = lambda: None):
        self.model, self.num_layers, self.budget = model, num_layers, budget
        self.probe = ActivationProbe(allocated)
        self.peak = peak  # the allocator's peak since `reset_peak` (called as the measuring update begins)
        self.update_peak: int | None = None
        # A layer boundary's hidden state: what a recomputed layer keeps (its checkpoint's input).
        self.boundary_bytes_per_token = model.config.hidden_size * model.dtype.itemsize
        self.decided = False
        self.reset_peak = reset_peak
        # Keep the last layer, to measure what a kept layer costs.
        model.gradient_checkpointing_enable(checkpointed_layers=num_layers - 1, activation_probe=self.probe)

    @classmethod
    def setup(cls, model, args, device: torch.device) -> "AutoCheckpointing | None":
        """Turn on checkpointing as `args` ask; an `AutoCheckpointing` when `auto` can measure, else None."""
        layers = args.gradient_checkpointing_layers
        base = base_model(model)
        if layers is not None and not isinstance(base, (CausalLM, TransformersCausalLM)):
            raise CohortError(f"gradient_checkpointing_layers={layers} needs cohort's engine (model_impl auto or "
                              f"cohort); {type(base).__name__} recomputes every layer: unset it, or pass model_impl=cohort")
        if layers != "auto":
            model.gradient_checkpointing_enable(**({} if layers is None else {"checkpointed_layers": layers}))
            return None
        model.gradient_checkpointing_enable()  # every layer until there is something to measure
        if device.type != "cuda":
            return None
        total = torch.cuda.get_device_properties(device).total_memory
        budget = args.max_memory_gib * 2**30 if args.max_memory_gib else BUDGET_SHARE * total
        num_layers = len(base.decoder_layers() if isinstance(base, TransformersCausalLM) else base.model.layers)
        return cls(base, num_layers, budget, lambda: torch.cuda.memory_allocated(device),
                   lambda: torch.cuda.max_memory_allocated(device), lambda: torch.cuda.reset_peak_memory_stats(device))

    @property
    def checkpointed(self) -> int:
        return self.model.checkpointed_layers

    @property
    def measuring(self) -> bool:
        """The next update is the one that measures (nothing decided yet, nothing measured)."""
        return not self.decided and self.update_peak is None

    def before_update(self) -> None:
        """The measuring update's peak counts from here."""
        if self.measuring:
            self.reset_peak()

    def after_update(self) -> None:
        """The measuring update is done: keep its memory peak for `decide`."""
        if not self.decided and self.probe.tokens:
            self.update_peak = self.peak()

    def decide(self, max_tokens: int) -> str | None:
        """Before each update: once one has been measured, set how many layers recompute, and
        return a line for the log (None when there is nothing to decide)."""
        if self.decided or self.update_peak is None:
            return None
        update_peak = self.update_peak
        self.decided = True
        per_token = self.probe.bytes_per_token
        kept_now = self.num_layers - self.checkpointed
        keep = layers_to_keep(self.num_layers, update_peak, kept_now, per_token, self.probe.tokens, max_tokens,
                              self.budget, self.boundary_bytes_per_token)
        self.model.gradient_checkpointing_enable(checkpointed_layers=self.num_layers - keep)
        return (f"gradient checkpointing auto: {keep} of {self.num_layers} layers keep their activations "
                f"({per_token * max_tokens / 2**30:.2f} GiB each at {max_tokens:,} tokens a micro-batch; "
                f"first update's peak {update_peak / 2**30:.1f} GiB, budget {self.budget / 2**30:.1f} GiB)")

    def checkpoint_all(self) -> bool:
        """Out of memory while keeping layers: checkpoint every one from now on. False if none was kept."""
        self.decided = True
        was_keeping = self.checkpointed < self.num_layers
        self.model.gradient_checkpointing_enable(checkpointed_layers=self.num_layers)  # and the probe detached
        return was_keeping
