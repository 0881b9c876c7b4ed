"""`Engine`: the fast `Sampler` for cohort's own `CausalLM`.

One preallocated `KVCache` (a row per slot), batched prefill of admitted prompts into their rows, then decode steps
over the occupied slots with sampling on the device. Finished sequences are noticed every `check_interval` steps
(one host sync), retired, and waiting sequences take their rows (continuous batching, see `scheduler.py`). The next
chunk of steps is enqueued before the host waits for the last one's progress, so the GPU does not idle during that
round trip (`overlap.py`). On CUDA each decode step (forward, sampling and slot-state update) is a captured CUDA
graph (`cuda_graphs.py`) whose elementwise pieces are torch.compile'd fused kernels
(`cohort_grpo.kernels.elementwise`), whose attention is a Triton flash-decoding kernel
(`cohort_grpo.kernels.decode_attention`) and whose sampling is one Triton pass over the logits
(`cohort_grpo.kernels.sampling`), so it launches a few kernels per layer. The model's own weights are used in place:
no copy, so the policy being trained samples its rollouts, as GRPO requires (DeepSeekMath 2024, Algorithm 1, step
"sample G outputs"). On a tensor-parallel shard (cohort_grpo/models/tensor_parallel.py) every rank runs the engine
on its slice of the vocabulary's logits, and the ranks sample over their slices without gathering them
(`token_sampler.py`, `vocab_parallel.py`). Here: the calls and their loop; a call's inputs are checked by
`request_checks.py`, and the model's mode and the KV cache's length and reuse are `engine_setup.py`'s.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from cohort_grpo.rollout.cuda_graphs import DecodeGraphs
from cohort_grpo.rollout.engine_setup import (KV_LENGTH_STEP, cache_fits, fuse_projections, sampling_mode,
                                             sequence_capacity)
from cohort_grpo.rollout.overlap import HostProgress, Retirement, Snapshot, to_device
from cohort_grpo.rollout.prefill import prefill
from cohort_grpo.rollout.request_checks import check_images, check_limits, check_request, check_turns
from cohort_grpo.rollout.sampling import sampling_key
from cohort_grpo.rollout.scheduler import ENGINE_SLOTS, Scheduler, batch_buckets, round_up_to_bucket
from cohort_grpo.rollout.sequence import Sequence, SlotState, assemble_rollout
from cohort_grpo.rollout.token_sampler import graph_capturable, shared_seed, token_sampler
from cohort_grpo.rollout.turns import TurnHandler, TurnKeeper
from cohort_grpo.errors import CohortError
from cohort_grpo.models.cache import KVCache
from cohort_grpo.kernels.elementwise import triton_available
from cohort_grpo.rollout.sampler import Rollout, SamplingParams, find_stop_string

class Engine:
    """KV-cache sampler with continuous batching; implements `cohort_grpo.rollout.Sampler`.

    max_batch_size: most sequences decoded at once (KV-cache rows).
    max_seq_len: prompt + completion tokens per row; None sizes the cache per call to the longest prompt +
        max_new_tokens (rounded up to 128 so later calls can reuse it).
    use_cuda_graph: None = on when the model is on CUDA.
    check_interval: decode steps between host syncs (finished rows are retired at these points).
    overlap_checks: enqueue the next chunk of decode steps before waiting for the previous one's progress (False:
        wait, then launch, the original order). The tokens are the same either way; so are the log-probs, up to
        float rounding where early stops change batch shapes.
    prefill_tokens: most (padded) prompt tokens per prefill forward.
    verify_graphs: compare each captured CUDA graph with an eager step (a self-check; slower).
    check_graphs: compare each captured graph's first replay with an eager step and decode without graphs from then
        on where they differ, with one notice (for modules cohort did not write, e.g. `TransformersCausalLM`'s: a
        value they take from the host during capture would be baked into the graph unseen).
    compile_kernels: use torch.compile'd fused kernels for norms, rotary, SwiGLU and sampling (None = on with CUDA
        graphs when triton is importable). If compilation fails, one notice is printed and the plain ops are used.
    """

    def __init__(self, model, tokenizer=None, max_batch_size: int = ENGINE_SLOTS, max_seq_len: int | None = None,
                 use_cuda_graph: bool | None = None, check_interval: int = 16, prefill_tokens: int = 16384,
                 verify_graphs: bool = False, compile_kernels: bool | None = None, overlap_checks: bool = True,
                 check_graphs: bool = False):
        if max_batch_size < 1:
            raise CohortError(f"max_batch_size={max_batch_size}: it must be at least 1")
        if check_interval < 1:
            raise CohortError(f"check_interval={check_interval}: it must be at least 1")
        self.model = model
        self.sample = token_sampler(model)  # a tensor-parallel shard's logits are its slice of the vocabulary
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise CohortError(f"use_cuda_graph=True needs the model on CUDA, it is on {self.device}; pass False")
        self.use_cuda_graph = use_cuda_graph
        # Graph mode pads decode steps to a few widths and KV lengths (few graphs to capture);
        # tests set this on the CPU to exercise that padding without CUDA.
        self.bucketed = use_cuda_graph
        self.check_interval = check_interval
        self.overlap_checks = overlap_checks
        self.prefill_tokens = prefill_tokens
        self.cache: KVCache | None = None
        self.state: SlotState | None = None
        if compile_kernels is None:
            compile_kernels = use_cuda_graph and triton_available()
        self.compile_kernels = compile_kernels
        self.graphs = DecodeGraphs(self._decode_step, enabled=use_cuda_graph,
                                   state=lambda: self.state.step_tensors() + self.cache.step_states(),
                                   verify=verify_graphs, check=check_graphs)
        self.stats: dict[str, float] = {}
        self._progress, self._retired = HostProgress(), []  # per generate() call (see _run)
        self._turns: TurnKeeper | None = None  # per multi-turn generate() call

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- public ------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams,
                 turns: TurnHandler | None = None, images: list | None = None) -> Rollout:
        """G = num_generations completions per prompt, rows group-contiguous (see `Sampler`). With
        `turns`, a sequence that ends a turn with budget left asks it what follows (turns.py): a tool's
        result is appended and the sequence rejoins the batch, while the others keep decoding. `images`: a
        vision-language model's images of each prompt (models/vision_language.py's `ImageInputs`, None for a
        text prompt), encoded once per prompt at its prefill."""
        check_images(self.model, images, len(prompt_ids), turns)
        check_turns(self.model, turns)
        check_request(prompt_ids, num_generations, params, self.tokenizer)
        longest = max(len(p) for p in prompt_ids)
        max_len = sequence_capacity(self.max_seq_len, self.cache, longest, longest + params.max_new_tokens)
        sequences = [
            Sequence(index=i * num_generations + g, prompt=list(prompt),
                     limit=min(params.max_new_tokens, max_len - len(prompt)), images=images[i] if images else None)
            for i, prompt in enumerate(prompt_ids) for g in range(num_generations)
        ]
        self._sample(sequences, max_len, params, turns=turns)
        return assemble_rollout(sequences, params.pad_token_id, multi_turn=turns is not None)

    def generate_until(self, prompt_ids: list[list[int]], limits: list[int], params: SamplingParams,
                       enough: Callable[[list[Sequence]], bool]) -> list[Sequence]:
        """One completion per prompt, `limits[i]` new tokens at most, stopped early once `enough(finished)`
        holds at a check (`finished`: the sequences done so far). The sequences still decoding then pause:
        each comes back with the tokens and log-probs it has, `finish_reason` None (partial rollouts,
        cohort_grpo/rollout/partial.py, continue them later from prompt + those tokens). The stop falls at a check,
        so where it falls depends on the tokens, never on timing."""
        check_request(prompt_ids, 1, params, self.tokenizer)
        check_limits(prompt_ids, limits, params)
        max_len = sequence_capacity(self.max_seq_len, self.cache, max(len(p) for p in prompt_ids),
                                    max(len(p) + n for p, n in zip(prompt_ids, limits)))
        sequences = [Sequence(index=i, prompt=list(prompt), limit=min(limit, max_len - len(prompt)))
                     for i, (prompt, limit) in enumerate(zip(prompt_ids, limits))]
        self._sample(sequences, max_len, params, enough=enough)
        for seq in sequences:
            if seq.tokens is None:  # never admitted before the stop
                seq.tokens, seq.logprobs = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.float32)
        return sequences

    def _sample(self, sequences: list[Sequence], max_len: int, params: SamplingParams,
                turns: TurnHandler | None = None, enough: Callable | None = None) -> None:
        num_slots = min(self.max_batch_size, len(sequences))
        buckets = batch_buckets(self.max_batch_size) if self.bucketed else None
        rows = round_up_to_bucket(num_slots, buckets) if buckets else num_slots
        started = time.perf_counter()
        self.stats = dict(decode_steps=0, decode_row_steps=0, prefill_forwards=0, prefill_tokens=0, prefill_shared_rows=0,
                          checks=0, slot_moves=0, speculative_chunks=0, speculative_steps=0)
        with sampling_mode(self.model, fused=self.compile_kernels):
            self._prepare(rows, max_len, params)
            seed = params.seed if params.seed is not None else int(torch.randint(2**31, (1,)).item())
            self.state.begin(shared_seed(self.model, seed), list(params.eos_token_ids or []))
            scheduler = Scheduler(num_slots, [b for b in buckets if b <= rows] if buckets else None)
            scheduler.add(sequences)
            self._turns = None if turns is None else TurnKeeper(turns, lambda seq: scheduler.add([seq]))
            try:
                self._run(scheduler, params, enough)
            finally:
                if turns is not None:
                    turns.close()
        self.stats["seconds"] = time.perf_counter() - started
        self.stats["graph_captures"] = self.graphs.captures
        if self._turns is not None:
            self.stats["turns_continued"] = self._turns.turns_continued

    def capture_graphs(self, num_sequences: int, max_len: int, max_new_tokens: int, pad_token_id: int = 0) -> int:
        """Capture ahead of time the decode graphs a call with `num_sequences` sequences of up to
        `max_len` tokens will need at full width (one per KV-length bucket), so that call spends
        no time capturing. Returns how many graphs exist; 0 without CUDA graphs."""
        if not self.graphs.enabled:
            return 0
        rows = round_up_to_bucket(min(num_sequences, self.max_batch_size), batch_buckets(self.max_batch_size))
        max_len = self.max_seq_len or -(-max_len // KV_LENGTH_STEP) * KV_LENGTH_STEP  # as generate() sizes it
        params = SamplingParams(max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
        with sampling_mode(self.model, fused=self.compile_kernels):
            self._prepare(rows, max_len, params)
            for cache_len in sorted({*range(KV_LENGTH_STEP, max_len, KV_LENGTH_STEP), max_len}):
                self.graphs(rows, cache_len, sampling_key(params))  # every slot is empty: a no-op step
        return len(self.graphs.graphs)

    def idle_buffers(self) -> list[torch.Tensor]:
        """The KV cache's tensors. Their contents are dead between calls (every call prefills its
        sequences anew), so the trainer lends them to the update's gradients (cohort_grpo/memory/lending.py)."""
        return [] if self.cache is None else self.cache.k_layers + self.cache.v_layers

    def release(self) -> None:
        """Free the KV cache, slot state and CUDA graphs (they are rebuilt by the next call)."""
        self.graphs.clear()
        self.cache = self.state = None

    # ---- setup -------------------------------------------------------------------------------
    def _prepare(self, rows: int, max_len: int, params: SamplingParams) -> None:
        """Reuse the cache, slot state and graphs when they fit, else reallocate them."""
        if self.device.type != "cuda":  # the model moved off the GPU after the Engine was built
            self.graphs.enabled = self.use_cuda_graph = False
        else:
            fuse_projections(self.model)
        if not cache_fits(self.cache, self.model, rows, max_len):
            self.release()  # drop the old cache (and the graphs reading it) before allocating anew
            with torch.inference_mode(False):  # a normal tensor: the update may borrow it (idle_buffers)
                self.cache = KVCache.for_model(self.model, rows, max_len)
        if self.state is None or not self.state.fits(self.cache.num_rows, params.max_new_tokens, params.pad_token_id):
            width = max(params.max_new_tokens, self.state.max_new_tokens if self.state is not None else 0)
            self.graphs.clear()
            self.state = SlotState(self.cache.num_rows, width, params.pad_token_id, self.device)
        self.graphs.follow_weights(self.model)

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self, scheduler: Scheduler, params: SamplingParams, enough: Callable | None = None) -> None:
        """Decode until every sequence is finished (or `enough` says the finished ones suffice: the rest
        pause). Each round launches a chunk of decode steps and reads the progress after the previous one
        (its one host sync); launching first (see `_launch_ahead`) keeps a chunk queued on the GPU while
        the host waits, retires and admits."""
        sampling = sampling_key(params)
        self._progress, self._retired = HostProgress(), []
        unread: Snapshot | None = None  # the progress after the last chunk launched, not yet read
        while True:
            launched = None
            if unread is None or self._launch_ahead(unread, scheduler, params):
                self._retire_at_limit(scheduler)
                if enough is not None and enough(scheduler.finished):
                    self._pause(scheduler)  # the sequences still decoding, as far as the enqueued steps take them
                    break
                if self._turns is not None:  # turns ended: ask what follows; answered ones rejoin
                    self._end_turns(params, block=scheduler.done and unread is None)
                self._turn_over(scheduler, params)
                if scheduler.done and not (self._turns is not None and (self._turns.busy or self._retired)):
                    break  # whatever is unread concerns sequences already retired
                launched = self._launch(scheduler, sampling, params)
                if launched is not None and unread is not None:
                    self.stats["speculative_chunks"] += 1
            if unread is not None:
                self._read(unread, scheduler, params)
            unread = launched
        for retirement in self._retired:  # the one wait for the retired rows' copies
            retirement.finish(self.tokenizer, params.stop, params.eos_token_ids or [])

    def _pause(self, scheduler: Scheduler) -> None:
        """Copy out every running sequence as it stands after the steps enqueued so far (a sequence that
        reached EOS or its limit in them is finished; the others come back with `finish_reason` None)."""
        running = [scheduler.slots[s] for s in scheduler.running_slots()]
        self._retire(scheduler, running, paused=True)
        scheduler.waiting.clear()

    def _end_turns(self, params: SamplingParams, block: bool) -> None:
        """Collect the retired rows whose copies have landed (all of them when `block`, as nothing else
        is left to do) and hand their turns to the TurnKeeper; resume those its handler has answered.
        With `block` and no row to collect, wait for an answer."""
        collected = False
        while self._retired and (block or self._retired[0].landed()):
            retirement = self._retired.pop(0)
            retirement.finish(self.tokenizer, params.stop, params.eos_token_ids or [])
            for seq in retirement.sequences:
                self._turns.turn_ended(seq)
            collected = True
        self._turns.poll(block=block and not collected)

    def _launch_ahead(self, unread: Snapshot, scheduler: Scheduler, params: SamplingParams) -> bool:
        """With `overlap_checks`, unless sequences wait and one in the unread chunk may have stopped
        early (EOS, stop string): its slot would idle a whole extra chunk before a waiting sequence
        took it, which over several waves adds decode steps and checks."""
        if not self.overlap_checks:
            return False
        may_stop_early = bool(params.eos_token_ids or params.stop)
        return not (scheduler.waiting and may_stop_early and any(
            seq.slot is not None and self._progress.upper(seq) < seq.limit for _, seq in unread.rows))

    def _turn_over(self, scheduler: Scheduler, params: SamplingParams) -> None:
        """Waiting sequences take the free slots (prefilled), then the running ones are packed."""
        admitted = scheduler.admit()
        if admitted:
            self._prefill(admitted, params)
        self._compact(scheduler)

    def _launch(self, scheduler: Scheduler, sampling: tuple, params: SamplingParams) -> Snapshot | None:
        """Enqueue a chunk of decode steps over the running slots, then a copy of the progress after
        it (tokens too for stop strings); None when none can advance. Sized from upper bounds on the
        counts (exact with nothing in flight): never short of a limit, never past the KV length."""
        rows = [(slot, scheduler.slots[slot]) for slot in scheduler.running_slots()]
        running = [seq for _, seq in rows]
        upper = [self._progress.upper(seq) for seq in running]
        steps = min(self.check_interval, max((seq.limit - n for seq, n in zip(running, upper)), default=0))
        if steps <= 0:
            return None
        width = scheduler.width()
        # A query at position p reads keys 0..p; a sequence's p is at most prompt + upper - 1 and
        # grows while it is unfinished, at most until its limit.
        furthest = max(len(seq.prompt) + n - 1 + min(steps, seq.limit - n) for seq, n in zip(running, upper))
        if self.bucketed:
            furthest = -(-furthest // KV_LENGTH_STEP) * KV_LENGTH_STEP
        cache_len = max(1, min(furthest, self.cache.max_len))
        step = self.graphs if graph_capturable(self.model, sampling) else self._decode_step  # see token_sampler.py
        for _ in range(steps):
            step(width, cache_len, sampling)
        self._progress.steps += steps
        self.stats["decode_steps"] += steps
        self.stats["decode_row_steps"] += steps * width
        columns = max(self._progress.upper(seq) for seq in running) if params.stop else None
        return Snapshot.enqueue(self.state, rows, self._progress.steps, columns)

    def _read(self, snapshot: Snapshot, scheduler: Scheduler, params: SamplingParams) -> None:
        """The host sync: wait for a chunk's progress, then retire the sequences it shows finished
        (EOS, limit) or cut by a stop string. Steps enqueued over them since were spent in vain."""
        snapshot.wait()
        self.stats["checks"] += 1
        finished, generated = snapshot.progress.tolist()
        retiring, cuts = [], []
        for slot, seq in snapshot.rows:
            if seq.slot is None or self._progress.known_at(seq) >= snapshot.steps:
                continue  # retired before this read (a multi-turn sequence may be in its next turn by now)
            self._progress.known(seq, generated[slot], snapshot.steps)
            cut = None
            if params.stop:
                cut = find_stop_string(self.tokenizer, snapshot.tokens[slot, : seq.generated].tolist(),
                                       seq.stop_checked_upto, params.stop)
                seq.stop_checked_upto = seq.generated
            if cut is not None or finished[slot]:
                retiring.append(seq)
                cuts.append(cut)
        self.stats["speculative_steps"] += sum(self._progress.pending(seq) for seq in retiring)
        self._retire(scheduler, retiring, cuts)

    def _retire_at_limit(self, scheduler: Scheduler) -> None:
        """Retire, without reading anything, the sequences that reach their limits within the steps
        already enqueued: by then they are finished (at the limit or by an earlier EOS) for sure."""
        running = [scheduler.slots[s] for s in scheduler.running_slots()]
        self._retire(scheduler, [seq for seq in running if self._progress.upper(seq) >= seq.limit])

    def _retire(self, scheduler: Scheduler, sequences: list[Sequence], cuts: list | None = None,
                paused: bool = False) -> None:
        """Free the slots of finished sequences. Their rows are copied out without waiting, up to the
        furthest count they can have reached (a row cut by a stop string may still be decoding in the
        chunk enqueued ahead; its columns below the cut never change), and collected at the end."""
        if not sequences:
            return
        slots = to_device([seq.slot for seq in sequences], self.device)
        columns = max(self._progress.upper(seq) for seq in sequences)
        self._retired.append(Retirement.enqueue(self.state, slots, sequences, cuts or [None] * len(sequences), columns,
                                                paused=paused, routes=self.cache.routes))
        self.state.clear(slots)  # after the copies in stream order: a freed row is rewritten only once read
        for seq in sequences:
            scheduler.retire(seq)

    def _decode_step(self, width: int, cache_len: int, sampling: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over slots [0, width): forward the last tokens, sample the next ones,
        record them in the slot state. Returns (tokens [width], log-probs [width]).

        Reads only persistent tensors (slot state, cache, weights), so it can be graph-captured.
        Slot s is cache row s, which is the model's default row for batch row s.
        """
        state = self.state
        logits = self.model(state.next_token[:width, None], state.position[:width, None],
                            kv_cache=self.cache, cache_len=cache_len)[:, 0]
        # The noise of token `generated[s]` of global sequence `sequence[s]`: independent of the slot.
        tokens, logprobs = self.sample(logits, *sampling, seed=state.seed, draw=state.generated[:width],
                                       rows=state.sequence[:width])
        state.advance(width, tokens, logprobs)
        return tokens, logprobs

    def _prefill(self, admitted: list[Sequence], params: SamplingParams) -> None:
        """The admitted sequences into their rows, each with its first token (prefill.py)."""
        counts = prefill(self.model, self.cache, self.state, admitted, params, self.prefill_tokens, self.sample)
        for seq in admitted:
            self._progress.known(seq, 1, self._progress.steps)
        for key, value in counts.items():
            self.stats[key] += value

    def _compact(self, scheduler: Scheduler) -> None:
        """Pack the running sequences into the narrowest bucket once no waiting one can fill the holes."""
        if scheduler.waiting:
            return
        moves = scheduler.compaction_moves()
        if moves:
            source = to_device([s for s, _ in moves], self.device)
            target = to_device([t for _, t in moves], self.device)
            state = self.state
            self.cache.move_rows(source, target)
            state.move(source, target)
            scheduler.apply_moves(moves)
            self.stats["slot_moves"] += len(moves)
