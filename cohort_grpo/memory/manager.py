"""`MemoryManager`: everything a GRPO step does to fit in the card's memory, owned by one object.

A step uses memory in phases, and each trick here moves a phase's memory out of another's way:

- sampling: π_ref's weights come back from the host while the engine samples (`offload.py`), and
  with `free_sampling_memory` the engine's KV cache and graphs are released after it;
- the reference pass: π_ref's weights on the device only inside it;
- the update: micro-batches of at most `micro_rows` completions / `micro_tokens` tokens, layers
  checkpointed as the budget needs (`checkpointed_layers.py`), gradients borrowed from the engine's
  idle KV cache (`lending.py`);
- out of memory: give up kept layers first (work with a backward), then halve the micro-batch;
- the host: Python's collector stops walking the run's long-lived objects after the first step
  (`gc_pauses.py`).

The loop calls it at those named points; nothing else reads or writes its sizes. It measures the
update's peak itself (`AutoCheckpointing.before_update`), so no other code's timing or counters
decide what it does.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from cohort_grpo.memory.checkpointed_layers import AutoCheckpointing
from cohort_grpo.memory.gc_pauses import freeze_long_lived_objects, thaw_frozen_objects
from cohort_grpo.memory.lending import idle_buffers, lend_gradients
from cohort_grpo.memory.offload import HostOffload
from cohort_grpo.parallel.placement import Placement

NO_GRAD_FACTOR = 2  # no-grad log-prob passes (π_old, π_ref) use micro-batches this many times larger
T = TypeVar("T")


class MemoryManager:
    def __init__(self, args, *, placement: Placement, auto_checkpointing: AutoCheckpointing | None, ref_model,
                 sampler, device: torch.device, layout, log: Callable[[str], None] = print,
                 release_weights: Callable[[], None] | None = None):
        self.args, self.device, self.log = args, device, log
        # `layout`: the run's `cohort_grpo.rollout.layout.Layout` (a room above this one: passed in, not imported)
        self.sampler, self.world_size, self.layout = sampler, placement.trainers, layout
        self.micro_rows, self.micro_tokens = args.per_device_train_batch_size, args.max_tokens_per_micro_batch
        # `gradient_checkpointing_layers=auto` (AutoCheckpointing.setup, called before the model is
        # wrapped): how many layers are checkpointed is decided by a measured update.
        self.auto_checkpointing = auto_checkpointing
        cuda = device.type == "cuda"
        # One process only: DDP and FSDP own their gradients, and FSDP shards π_ref its own way.
        self.ref_offload = HostOffload(ref_model, enabled=args.offload_ref_model and cuda and not placement.fsdp)
        self.lend_kv_cache = args.lend_kv_cache and placement.trainers == 1 and not placement.fsdp
        self.release_sampler = args.free_sampling_memory and cuda and hasattr(sampler, "release")
        # FSDP2: the engine's weights too, until the refresh after the update rewrites them; on a GPU only with
        # the graphs (they read the weights by address and are recaptured from the new ones).
        self.release_weights = (release_weights if placement.engine_released_in_update and placement.sharded
                                and (self.release_sampler or not cuda) else None)
        self.oom_retries = 0
        self.lent_bytes = 0

    # ---- the step's named points ---------------------------------------------------------------
    def before_sampling(self) -> None:
        """π_ref's weights start back from the host: the copy runs while the engine samples."""
        self.ref_offload.prefetch()

    def after_sampling(self) -> None:
        """KV cache and decode graphs out of the update's memory (recaptured next step), when asked."""
        if self.release_sampler:
            self.sampler.release()
        if self.release_weights is not None:
            self.release_weights()

    def reference_pass(self, modified: bool = False):
        """π_ref's weights on the device inside the block (`modified`: the block writes them)."""
        return self.ref_offload.on_device(modified=modified)

    @contextmanager
    def update(self, params: Iterable[torch.Tensor]) -> Iterator[None]:
        """One optimizer step's gradients: those of `params` borrow the engine's idle KV cache."""
        buffers = idle_buffers(self.sampler) if self.lend_kv_cache else []
        with lend_gradients(params, buffers) as lent:
            self.lent_bytes = lent
            yield

    def before_update(self) -> None:
        """`auto`: once the first update has measured, decide how many layers keep their activations."""
        if self.auto_checkpointing is None:
            return
        line = self.auto_checkpointing.decide(self.largest_micro_batch_tokens())
        if line:
            self.log(line)
        self.auto_checkpointing.before_update()

    def after_update(self) -> None:
        if self.auto_checkpointing is not None:
            self.auto_checkpointing.after_update()

    def after_first_step(self) -> None:
        """The run's long-lived objects exist now: full collections stop walking them."""
        if self.args.gc_freeze:
            freeze_long_lived_objects()

    def end_of_run(self) -> None:
        """The run trained to its end: π_ref whole on the device again, for `on_train_end` and the caller."""
        self.ref_offload.restore()

    def close(self) -> None:
        """End of the run (also when it raises): a later run in this process can reclaim this one's objects."""
        thaw_frozen_objects()

    # ---- out of memory -------------------------------------------------------------------------
    def run(self, work: Callable[[], T], backward: bool = False, release: Callable[[], None] = lambda: None) -> T:
        """Run `work()`; if the GPU runs out of memory, `release()` what the attempt held, shrink, and
        run it again. Work with a `backward` first gives up layers that keep their activations, if any
        do; the no-grad passes keep none, so that would not help them. Then the micro-batch halves.

        The smaller sizes are kept for the rest of the run. The retried work starts afresh (the update
        zeroes its gradients first), so its result is that of the smaller size from the start. Several
        ranks cannot retry alone (the others would wait in an all-reduce)."""
        while True:
            try:
                return work()
            except torch.cuda.OutOfMemoryError:
                release()
                if self.world_size > 1:
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if backward and self.auto_checkpointing is not None and self.auto_checkpointing.checkpoint_all():
                    self.oom_retries += 1
                    self.log("out of GPU memory with layers keeping their activations (gradient_checkpointing_layers"
                             "=auto): checkpointing every layer from now on")
                    continue
                if self.micro_rows == 1:  # one row: no smaller micro-batch exists
                    raise
                before = (self.micro_rows, self.micro_tokens)
                self.micro_rows = max(1, self.micro_rows // 2)
                self.micro_tokens //= 2
                self.oom_retries += 1
                self.log(f"out of GPU memory with micro-batches of {before[0]} completions"
                         f"{f' / {before[1]} tokens' if before[1] else ''}: retrying with {self.micro_rows}"
                         f"{f' / {self.micro_tokens} tokens' if self.micro_tokens else ''}")

    def optimizer_shrank(self, times: int, chunk_bytes: int) -> None:
        """The fp32-master step halved its chunks `times` times instead of failing (precision.py)."""
        self.oom_retries += times
        self.log(f"out of GPU memory in the optimizer step: it now steps at most {chunk_bytes / 2**20:.1f} MiB "
                 "of fp32 gradients at a time")

    # ---- sizes ---------------------------------------------------------------------------------
    def no_grad_sizes(self) -> tuple[int, int]:
        """(rows, tokens) of a no-grad log-prob pass's micro-batches: no activations are kept, so
        they are NO_GRAD_FACTOR times the training ones."""
        return self.micro_rows * NO_GRAD_FACTOR, self.micro_tokens * NO_GRAD_FACTOR

    def largest_micro_batch_tokens(self) -> int:
        """Tokens a training micro-batch can reach under the current budgets: every row at the
        longest prompt and completion, as the run's layout lays them out (`Layout.full_length_tokens`)."""
        tokens = self.layout.full_length_tokens(self.micro_rows, self.args.max_prompt_length,
                                                self.args.max_completion_length)
        return min(tokens, self.micro_tokens) if self.micro_tokens else tokens

    def update_metrics(self) -> dict[str, float]:
        """What an update reports of the memory it ran in: the bytes it borrowed, and with `auto`
        how many layers were checkpointed."""
        record = {"memory/lent_gib": self.lent_bytes / 2**30}
        if self.auto_checkpointing is not None:
            record["checkpointed_layers"] = self.auto_checkpointing.checkpointed
        return record
