"""What one GPU holds at the peak of each phase of a GRPO step, from the model's config alone (no weights).

`training_memory_plan` counts, in bytes, the tensors cohort's own code keeps on a training rank. Every term
comes from a place in the code; the figure and its source:

Resident through the step (`resident`):
- full parameters, one GPU or DDP: the bf16 weights (2 bytes a parameter; `--dtype`), the fp32 master's low
  half (2: `precision.MasterWeightAdamW`, `bf16.split_master`) and AdamW's two moments (4 in bf16, the GPU
  default, or 8: `optimizer_state_dtype`). The engine samples from the same weights. With `offload_optimizer`
  the low halves and moments wait in host memory (`MemoryPlan.host`, `optim/host_state.py`) and the optimizer
  step stages two pieces of state on the GPU at a time (a tensor, or a slice of at most
  `host_state.PIECE_ELEMENTS` of a larger one; one chunk's, with fp32 moments).
- FSDP2 over N ranks (`parallel/distributed.py` `_fully_shard`): the engine's copy of the weights in bf16 (a whole
  copy, or 1/T of it where the engine is a T-way tensor-parallel shard), the fp32 master shard (4/N) and AdamW's
  moments on it, as on one GPU (4/N in bf16, the GPU default: `sharded_adamw.ShardedAdamW`; 8/N in fp32).
- LoRA (`models/lora.py`): the frozen bf16 base, and the adapters trained in fp32 (weights, moments: 12 bytes
  an adapter parameter).
- π_ref (β > 0, without LoRA): a bf16 copy (`models/policy.frozen_copy`); on one GPU it waits on the host
  outside the log-prob pass (`offload.HostOffload`), under FSDP it stays.
- asynchronous rollouts in one process: the producer's copy of the policy (`rollout/setup.py`).
- the engine's KV cache (`rollout/engine.py`): min(256, the rows of one engine call) slots of prompt +
  completion tokens rounded up to 128, K and V of every layer, split by KV head over a tensor-parallel group;
  kept between rollouts unless `free_sampling_memory`. A model with linear-attention layers adds each slot's
  recurrent states (`StepShape.state_bytes` a sequence: `models/recurrent_state.row_bytes`), which the
  gradients do not borrow.

The backward (`backward`) adds the gradients and the largest micro-batch's activations, the optimizer step
(`optimizer step`) the gradients and the step's scratch:
- gradients: 2 bytes a parameter on one GPU, lent the idle KV cache where it holds them (`lending.py`), plus
  DDP's buckets (a second copy) on several ranks. FSDP2: the fp32 gradient shard (4/N), reduce-scattered after
  every micro-batch (`Parallel.no_sync`); were the reduce-scatter skipped until the last micro-batch, FSDP2
  would keep every parameter's unsharded gradient, upcast to the fp32 reduce dtype
  (`FSDPParam.to_accumulated_grad_if_needed`): 4 bytes a parameter, unsharded (`sync_every_micro_batch=False`);
- FSDP2's gathered parameters: the root's embeddings, head and norm in bf16 for the whole forward and
  backward, two decoder layers at a time (the one computing, the one prefetched), and one layer's gradient in
  bf16 and in fp32 for its reduce-scatter; its optimizer step with bf16 moments widens one slice of a tensor
  at a time (`sharded_adamw.CHUNK_ELEMENTS`, `SCRATCH_BYTES_PER_ELEMENT`), with fp32 moments it is torch's
  fused AdamW (`optimizer.make_optimizer`), which makes no temporary (torch's foreach step would make one the
  size of the shard, √v̂ + ε: `optimizer_temporary`);
- tokens: a micro-batch is `per_device_train_batch_size` rows and at most `max_tokens_per_micro_batch`
  tokens (`auto`: `fast_path.micro_batch_tokens`), but never less than one unit, a prompt with the group's
  completions when prompts are shared (`Layout.plan`: a unit longer than the cap is a micro-batch alone);
- per token, a checkpointed layer keeps its input (hidden × 2 bytes); the layer being recomputed keeps what
  its backward reads, estimated as 2 × (4 hidden + 2 q + 2 kv + 3 intermediate) bytes (the norms' inputs and
  outputs, q/k/v, the attention output, the MLP's gate, up and product: 73 KB a token at the Qwen2.5-1.5B
  shape, where `checkpointed_layers.ActivationProbe` measured 75 KB), counted twice for the gradients in
  flight; without checkpointing every layer keeps it. A mixture of experts' layer keeps, in place of the MLP's
  three, each of a token's k copies (its row sorted by expert, gate, up, their product and the expert's output:
  2 hidden + 3 expert-intermediate) and the router's fp32 softmax (142 KB a token at a 64-expert, top-8 shape of
  hidden 2,048, where the probe measured 150 KB); `gradient_checkpointing_layers=auto` keeps more layers where the
  budget allows: the plan is the least the step needs;
- the fused head (`update/fused_head.py`): the head's gradient (vocabulary × hidden, bf16) and ∂loss/∂hidden
  made in the forward and held to the backward, one chunk of logits (`logprobs.CHUNK_BYTES` in fp32, and the
  bf16 logits it came from).

A distillation teacher's weights (`teacher_bytes`, from its own config) stay on the GPU through every phase.
The log-prob pass (`logprobs`) holds π_ref's weights (when β > 0) and one layer's activations of a no-grad
micro-batch twice the update's (`manager.NO_GRAD_FACTOR`). FSDP2's set-up (`setup`) holds, besides the loaded
bf16 model, the fp32 shards `Parallel.sharded_copy` allocates and fills slice by slice (it shards a copy on the
meta device first; a whole fp32 copy widened before sharding, `widen_after_sharding=False`, would be 4 bytes a
parameter on every rank).

Checked against measurements: FSDP2 over 4 H200s at the Qwen2.5-7B shape (docs/performance.md, 16 prompts × 4
of 128 tokens, 2 micro-batches, measured while FSDP2 still accumulated unsharded gradients and kept fp32
moments: the `RankShape` with `sync_every_micro_batch=False`, `optimizer_state_dtype=float32`) peaked at 69.4
GiB, the plan says 70.6 (the unsharded fp32 gradients are 28.4 of it); one H200 at that shape with fp32 moments
peaked at 104.4 GiB, the plan says 103.3 (with bf16 moments, 73.8). `RankShape`'s defaults are what the code
does; its other settings price changes (or the code as it was).

Left out (each well under a GiB at these sizes, or outside what a model's config says): the CUDA context and
NCCL's buffers, CUDA graph pools, the allocator's fragmentation, the decode step's logits. The refusal
(`capacity.py`) therefore compares the plan with the whole free memory, not a share of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cohort_grpo.models.config import ModelConfig
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.rollout.layout import Layout
from cohort_grpo.rollout.scheduler import ENGINE_SLOTS
from cohort_grpo.update.fast_path import tokens_for_work
from cohort_grpo.update.logprobs import CHUNK_BYTES
from cohort_grpo.optim.host_state import PIECE_ELEMENTS, holds_split_masters
from cohort_grpo.optim.precision import GRADIENT_CHUNK_BYTES, resolve_dtype
from cohort_grpo.plans.sampling_plan import active_parameter_count, kv_cache_bytes, kv_length, layer_parameter_counts, parameter_count
from cohort_grpo.optim.sharded_adamw import CHUNK_ELEMENTS, SCRATCH_BYTES_PER_ELEMENT

GIB = 2**30
NO_GRAD_FACTOR = 2  # no-grad log-prob micro-batches are this many times the update's (manager.py)


@dataclass(frozen=True)
class StepShape:
    """What a training rank's step is made of, and how the run keeps its memory: the options of a
    `GRPOConfig` the plan reads, with `auto` settled as on a GPU with cohort's own models."""

    rows: int  # completions a rank samples and trains on per step
    group: int  # G
    prompt_len: int
    completion_len: int
    micro_rows: int
    micro_tokens: int | str = "auto"  # 0: rows only
    checkpointing: bool = True
    share_prompt_prefix: bool = True
    dtype: str = "bfloat16"  # the weights' dtype on the GPU (`auto` is bfloat16 there): their bytes, the optimizer's kind
    moment_bytes: int = 4  # AdamW's two moments, one GPU or FSDP2's shard: bf16 (8 for fp32)
    lora_rank: int = 0  # 0: full parameters
    reference: bool = False  # β > 0 and no LoRA: a π_ref copy
    teacher_bytes: int = 0  # on-policy distillation: the teacher's weights, on the GPU all step (0: no teacher)
    offload_reference: bool = True
    async_copy: bool = False  # asynchronous rollouts in this process: the producer's copy of the policy
    lend_kv_cache: bool = True
    free_sampling_memory: bool = False
    engine_slots: int = ENGINE_SLOTS
    state_bytes: int = 0  # each engine slot's recurrent states (linear-attention layers), beside its KV cache
    offload_optimizer: bool = False  # one process, full parameters: AdamW's state in host memory

    @classmethod
    def from_config(cls, args, placement: Placement) -> "StepShape":
        """The step of the run `args` (a validated `GRPOConfig`) on a GPU, placed by `placement`."""
        dtype = resolve_dtype(args.dtype, torch.device("cuda"))  # a plan is of a GPU's step
        fp32 = dtype == "float32"
        return cls(rows=args.per_device_train_batch_size * args.gradient_accumulation_steps, group=args.num_generations,
                   prompt_len=args.max_prompt_length, completion_len=args.max_completion_length,
                   micro_rows=args.per_device_train_batch_size, micro_tokens=args.max_tokens_per_micro_batch,
                   checkpointing=args.gradient_checkpointing is not False,
                   share_prompt_prefix=args.share_prompt_prefix, dtype=dtype,
                   moment_bytes=8 if fp32 or args.optimizer_state_dtype == "float32" else 4,
                   lora_rank=args.lora_r if args.use_peft else 0, reference=args.beta > 0 and not args.use_peft,
                   offload_reference=args.offload_ref_model,
                   async_copy=placement.producer_copy, lend_kv_cache=args.lend_kv_cache,
                   free_sampling_memory=args.free_sampling_memory, offload_optimizer=args.offload_optimizer is True,
                   engine_slots=slots if isinstance(slots := args.max_concurrent_sequences, int) else ENGINE_SLOTS)

    @property
    def element_bytes(self) -> int:
        """Bytes of a weight (and of an activation, a KV-cache entry): 4 in float32, else 2."""
        return 4 if self.dtype == "float32" else 2

    @property
    def layout(self) -> Layout:
        """The layout of the step's passes, as the run decides it for cohort's own models (`Layout.choose`)."""
        return Layout.choose(self.share_prompt_prefix, self.group)


@dataclass(frozen=True)
class RankShape:
    """What a training rank holds: `ranks` training ranks (FSDP2 over them with `fsdp`, else each holds the whole
    model: one GPU or DDP); the engine's weights split `sampling_split` ways (a tensor-parallel shard per rank);
    `samples`: this rank runs the engine (not a trainer whose rollouts come from sampling ranks)."""

    ranks: int = 1
    fsdp: bool = False
    sampling_split: int = 1
    samples: bool = True
    # How the FSDP2 state is kept. The defaults are what the code does; the others are what a change would give,
    # or what the code did before (bench/scale.py --plan shows which change lets a model fit).
    # fp32 moments on the shard: torch's fused AdamW steps them; True: the foreach step and its temporary
    optimizer_temporary: bool = False
    engine_in_update: bool = True  # the engine's weights stay on the GPU through the update
    widen_after_sharding: bool = True  # shards allocated and filled slice by slice; False: a whole fp32 copy first
    sync_every_micro_batch: bool = True  # a reduce-scatter every micro-batch; False: unsharded fp32 accumulation

    @classmethod
    def of(cls, placement: Placement) -> "RankShape":
        """What a training rank of `placement` holds, its split perhaps still `auto`: the plan takes the widest
        split `auto` may choose (`Placement.widest_split`), so that no run `auto` could fit is refused."""
        return cls(ranks=placement.trainers, fsdp=placement.sharded, sampling_split=placement.widest_split,
                   samples=not placement.rollout_gpus,
                   engine_in_update=not (placement.sharded and placement.engine_released_in_update))

    @property
    def sharded(self) -> bool:
        return self.fsdp and self.ranks > 1


@dataclass
class MemoryPlan:
    """Bytes per GPU: `phases[phase][term]`. A phase's total is what is allocated at its peak."""

    parameters: int
    rank: RankShape
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    step: StepShape | None = None  # the step planned
    host: dict[str, int] = field(default_factory=dict)  # what waits in host memory: π_ref, the optimizer's state

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    def describe(self, phase: str | None = None, terms: int = 4) -> str:
        """`update 97.3 GiB: moments 29.9, weights 15.0, ...`: a phase's total and its largest terms."""
        phase = phase or self.peak_phase
        largest = sorted(self.phases[phase].items(), key=lambda item: -item[1])[:terms]
        return (f"{phase} {self.total(phase) / GIB:.1f} GiB: "
                + ", ".join(f"{name} {size / GIB:.1f}" for name, size in largest if size))

    def as_dict(self) -> dict:
        return dict(parameters=self.parameters, rank=vars(self.rank), peak_phase=self.peak_phase,
                    peak_gib=round(self.peak / GIB, 2),
                    phases={phase: {"total_gib": round(self.total(phase) / GIB, 2),
                                    **{name: round(size / GIB, 3) for name, size in terms.items()}}
                            for phase, terms in self.phases.items()})


def offloaded(step: StepShape, rank: RankShape) -> bool:
    """Whether AdamW's state waits in host memory: asked, weights whose optimizer keeps split masters (bf16:
    `holds_split_masters`, the rule `run/resolve.py` refuses the rest by), full parameters, one process."""
    return step.offload_optimizer and holds_split_masters(step.dtype) and not step.lora_rank and rank.ranks == 1


def largest_tensor_elements(config: ModelConfig) -> int:
    """The elements of the model's largest weight tensor: the embedding, an MLP projection, or a mixture of experts'
    fused gate and up projections (every expert's in one tensor)."""
    hidden = config.hidden_size
    experts = config.num_experts * 2 * config.moe_intermediate_size * hidden if config.num_experts else 0
    return max(config.vocab_size * hidden, config.intermediate_size * hidden, experts,
               config.num_attention_heads * config.head_dim * hidden)


def layer_parameter_count(config: ModelConfig) -> int:
    """The largest decoder layer's weights (FSDP2 gathers one layer at a time; a mixture of experts' layer
    holds all its experts)."""
    return max(layer_parameter_counts(config))


def lora_parameter_count(config: ModelConfig, rank: int) -> int:
    """Adapters of rank `rank` on every attention and MLP projection (`--lora_target_modules`' default): r ×
    (inputs + outputs) for q, k, v, o, gate, up and down of every layer."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = (hidden + q) * 2 + (hidden + kv) * 2 + (hidden + inner) * 3
    return config.num_hidden_layers * rank * per_layer


def layer_activation_bytes_per_token(config: ModelConfig, element_bytes: int) -> list[int]:
    """What each decoder layer, keeping its activations, holds for its backward per token (see the docstring)."""
    hidden = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attention = 4 * hidden + 2 * q + 2 * kv
    dense = element_bytes * (attention + 3 * config.intermediate_size)
    # each of a token's k copies: its row sorted by expert, gate, up and their product, the expert's output
    copies = config.num_experts_per_tok * (2 * hidden + 3 * config.moe_intermediate_size)
    sparse = element_bytes * (attention + copies) + 4 * config.num_experts  # the router's softmax in fp32
    return [sparse if config.is_sparse_layer(i) else dense for i in range(config.num_hidden_layers)]


def activation_bytes_per_token(config: ModelConfig, element_bytes: int) -> int:
    """The most any one decoder layer keeping its activations holds for its backward, per token."""
    return max(layer_activation_bytes_per_token(config, element_bytes))


def micro_batch_tokens(config: ModelConfig, step: StepShape) -> int:
    """Tokens of the largest training micro-batch the step can make (see the docstring)."""
    rows, layout = min(step.micro_rows, step.rows), step.layout
    unit = layout.full_length_tokens(layout.unit_rows(rows), step.prompt_len, step.completion_len)
    whole = layout.full_length_tokens(rows, step.prompt_len, step.completion_len)
    cap = step.micro_tokens
    if cap == "auto":
        cap = tokens_for_work(active_parameter_count(config))
    return max(unit, min(whole, cap)) if cap else whole


def several_micro_batches(config: ModelConfig, step: StepShape) -> bool:
    """Whether the step's update takes more than one micro-batch (gradients accumulate between them)."""
    whole = step.layout.full_length_tokens(step.rows, step.prompt_len, step.completion_len)
    return step.rows > step.micro_rows or micro_batch_tokens(config, step) < whole


def engine_kv_bytes(config: ModelConfig, step: StepShape, split: int) -> int:
    """One rank's share of the engine's KV cache: a group of `split` ranks samples its ranks' rows in one call."""
    rows = min(step.engine_slots, step.rows * split)
    length = kv_length(step.prompt_len, step.completion_len)
    return math.ceil(kv_cache_bytes(config, rows, length, step.element_bytes) / split)


def engine_state_bytes(step: StepShape, split: int) -> int:
    """One rank's share of the recurrent states of the engine's slots (`engine_kv_bytes`' rows)."""
    return math.ceil(min(step.engine_slots, step.rows * split) * step.state_bytes / split)


def training_state(config: ModelConfig, step: StepShape,
                   rank: RankShape) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """What the trained weights cost a rank: (resident — the weights, masters and moments kept all step;
    gradients; the optimizer step's temporaries), sharded over FSDP2's ranks or whole (one GPU, DDP, LoRA)."""
    params, w = parameter_count(config), step.element_bytes
    n = rank.ranks if rank.sharded else 1
    lora = lora_parameter_count(config, step.lora_rank) if step.lora_rank else 0
    trained = lora or params
    resident: dict[str, int] = {}
    gradients: dict[str, int] = {}
    optimizer: dict[str, int] = {}
    if rank.sharded:
        resident["engine weights"] = math.ceil(params * w / rank.sampling_split)
        resident["fp32 master shard"] = math.ceil(params * 4 / n)  # a frozen LoRA base is sharded in fp32 too
        resident["moments"] = math.ceil(trained * step.moment_bytes / n)
        gradients["gradients"] = math.ceil(trained * 4 / n)
        if step.moment_bytes == 4:  # bf16 moments: one slice of a tensor widened at a time
            optimizer["optimizer chunk"] = CHUNK_ELEMENTS * SCRATCH_BYTES_PER_ELEMENT
        elif rank.optimizer_temporary:  # torch's foreach AdamW: √v / bias correction + ε, every shard at once
            optimizer["optimizer temporary"] = math.ceil(trained * 4 / n)
    else:
        resident["weights"] = params * w
        if lora:
            resident["adapters"] = lora * 4
            resident["moments"] = lora * 8
            gradients["gradients"] = lora * 4
        else:
            if offloaded(step, rank):  # each tensor's state visits the GPU for its own step: two slots of it
                per_element = 2 + step.moment_bytes
                if step.moment_bytes == 4:  # the kernel's: two pieces (a tensor, or a slice of a larger one)
                    optimizer["optimizer staging"] = 2 * min(largest_tensor_elements(config),
                                                             PIECE_ELEMENTS) * per_element
                else:  # the chunked torch step's: one chunk of state
                    optimizer["optimizer staging"] = max(GRADIENT_CHUNK_BYTES // 4,
                                                         largest_tensor_elements(config)) * per_element
            else:
                resident["master low halves"] = params * 2 if w == 2 else 0
                resident["moments"] = params * step.moment_bytes
            gradients["gradients"] = params * w
            if rank.ranks > 1:
                gradients["DDP buckets"] = params * w
            if w == 2 and step.moment_bytes == 8:  # the chunked torch step: fp32 gradients, masters, moments
                optimizer["optimizer chunk"] = 4 * GRADIENT_CHUNK_BYTES
    return resident, gradients, optimizer


def backward_terms(config: ModelConfig, step: StepShape, rank: RankShape, trained: int) -> dict[str, int]:
    """The backward pass's own terms beside the state: a micro-batch's activations (its checkpointed layers'
    inputs, or every layer's), the LM head's chunk and gradient, and under FSDP2 the gathered weights."""
    w, hidden, vocab = step.element_bytes, config.hidden_size, config.vocab_size
    tokens = micro_batch_tokens(config, step)
    terms: dict[str, int] = {}
    if step.checkpointing:
        terms["activations"] = tokens * (config.num_hidden_layers * hidden * w + 2 * activation_bytes_per_token(config, w))
    else:
        terms["activations"] = tokens * sum(layer_activation_bytes_per_token(config, w))
    completion_tokens = tokens - step.prompt_len  # the head runs on completion tokens only
    terms["LM head chunk"] = int(CHUNK_BYTES * 1.5) + completion_tokens * hidden * w * 2
    terms["LM head gradient"] = vocab * hidden * w if not step.lora_rank else 0
    if rank.sharded and several_micro_batches(config, step) and not rank.sync_every_micro_batch:
        # Without a reduce-scatter, FSDP2 accumulates each parameter's unsharded gradient, upcast to the fp32
        # reduce dtype (`FSDPParam.to_accumulated_grad_if_needed`), until the last micro-batch: all of them.
        terms["gradients"] = trained * 4
    if rank.sharded:
        terms["gathered root"] = (vocab * hidden * (1 if config.tie_word_embeddings else 2) + hidden) * 2
        layer = layer_parameter_count(config)
        terms["gathered layers"] = 2 * layer * 2 + layer * (2 + 4)
    return terms


def training_memory_plan(config: ModelConfig, step: StepShape, rank: RankShape = RankShape()) -> MemoryPlan:
    """The bytes a training rank holds in each phase of a GRPO step (see the module's docstring)."""
    params, w = parameter_count(config), step.element_bytes
    hidden = config.hidden_size
    n = rank.ranks if rank.sharded else 1
    lora = lora_parameter_count(config, step.lora_rank) if step.lora_rank else 0
    resident, gradients, optimizer = training_state(config, step, rank)
    copy = params * w
    # The colocated placement shards π_ref like the policy (parallel/colocation.py); else each rank holds it whole.
    reference = math.ceil(copy / rank.ranks) if rank.sharded and rank.sampling_split > 1 else copy
    if step.reference and (rank.sharded or not step.offload_reference):
        resident["π_ref"] = reference
    if step.async_copy:
        resident["sampler copy"] = copy
    if step.teacher_bytes:
        resident["π_teacher"] = step.teacher_bytes
    kv = engine_kv_bytes(config, step, rank.sampling_split) if rank.samples else 0
    resident["KV cache"] = kv
    if step.state_bytes and rank.samples:
        resident["recurrent states"] = engine_state_bytes(step, rank.sampling_split)
    after_sampling = dict(resident)
    if step.free_sampling_memory:
        after_sampling["KV cache"] = 0  # released after sampling (and then lends nothing)
        after_sampling.pop("recurrent states", None)
    if rank.sharded and not rank.engine_in_update:
        after_sampling["engine weights"] = 0
    elif step.lend_kv_cache and rank.ranks == 1 and not rank.fsdp and not lora:
        gradients["gradients"] -= min(gradients["gradients"], kv)  # the gradients borrow the idle cache

    backward = {**after_sampling, **gradients, **backward_terms(config, step, rank, lora or params)}
    tokens = micro_batch_tokens(config, step)
    per_token = activation_bytes_per_token(config, w)

    plan = MemoryPlan(params, rank, step=step)
    if step.reference and not rank.sharded and step.offload_reference:
        plan.host["π_ref"] = copy
    if offloaded(step, rank):
        plan.host["optimizer state"] = params * (2 + step.moment_bytes)
    plan.phases["sampling"] = resident
    logprobs = dict(after_sampling)
    if step.reference:
        logprobs["π_ref"] = reference
    logprobs["activations"] = NO_GRAD_FACTOR * tokens * (hidden * w * 2 + per_token)
    logprobs["LM head chunk"] = int(CHUNK_BYTES * 1.5)
    plan.phases["logprobs"] = logprobs
    plan.phases["backward"] = backward
    plan.phases["optimizer step"] = {**after_sampling, **gradients, **optimizer}
    if rank.sharded:
        widened = math.ceil(params * 4 / n) if rank.widen_after_sharding else params * 4
        plan.phases["setup"] = {"loaded model": copy, "fp32 shards" if rank.widen_after_sharding
                                else "fp32 copy to shard": widened}
    return plan
