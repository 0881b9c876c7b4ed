"""The training memory plan (cohort_grpo/plans/training_plan.py) against the tensors cohort really makes, and the
refusal before loading (cohort_grpo/plans/capacity.py) on a GPU whose capacity the test sets."""

import json
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.plans import capacity
from cohort_grpo.parallel.placement import Placement
from cohort_grpo.plans.capacity import check_capacity, config_before_loading
from cohort_grpo.optim.optimizer import make_optimizer
from cohort_grpo.optim.sharded_adamw import CHUNK_ELEMENTS, SCRATCH_BYTES_PER_ELEMENT, ShardedAdamW
from cohort_grpo.plans.training_plan import (GIB, RankShape, StepShape, activation_bytes_per_token, engine_kv_bytes,
                                         lora_parameter_count, micro_batch_tokens, training_memory_plan)
from cohort_grpo.models import CausalLM, ModelConfig
from cohort_grpo.rollout.engine import Engine
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.rollout.layout import Layout

TINY = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Llama-3.1-8B's shape (config.json): 8.03 billion weights.
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_one_gpu_terms_are_the_optimizers_state():
    """bf16 weights: the optimizer's low halves and bf16 moments are the plan's terms, byte for byte."""
    torch.manual_seed(0)
    model = CausalLM(TINY).to(torch.bfloat16)
    optimizer = make_optimizer(model, GRPOConfig(dtype="bfloat16").validate())
    moments = [t for state in optimizer.state.values() for name, t in state.items() if name.startswith("exp_avg")]
    step = StepShape(rows=8, group=4, prompt_len=8, completion_len=8, micro_rows=4, lend_kv_cache=False)
    plan = training_memory_plan(TINY, step)
    sampling = plan.phases["sampling"]
    assert sampling["weights"] == tensor_bytes(model.parameters())
    assert sampling["master low halves"] == tensor_bytes(optimizer.lows)
    assert sampling["moments"] == tensor_bytes(moments)
    # the update's gradients are the weights' size, and only there
    assert plan.phases["optimizer step"]["gradients"] == tensor_bytes(model.parameters())
    assert "gradients" not in sampling


def test_with_the_state_in_host_memory_the_gpu_keeps_weights_and_staging_and_the_host_the_state():
    """offload_optimizer: the low halves and moments leave every GPU phase for the host, byte for byte the buffers
    `MasterWeightAdamW(offload=True)` makes, and the optimizer step stages two of the largest tensor's state."""
    torch.manual_seed(0)
    model = CausalLM(TINY).to(torch.bfloat16)
    optimizer = make_optimizer(model, GRPOConfig(dtype="bfloat16", offload_optimizer=True).validate())
    assert optimizer.host is not None
    step = StepShape(rows=8, group=4, prompt_len=8, completion_len=8, micro_rows=4, lend_kv_cache=False)
    kept, moved = (training_memory_plan(TINY, replace(step, offload_optimizer=on)) for on in (False, True))
    params = sum(p.numel() for p in model.parameters())
    # the host holds what the device plan dropped (the buffers' per-tensor alignment aside)
    assert moved.host == {"optimizer state": params * 6}
    assert params * 6 <= optimizer.host.nbytes <= params * 6 + 3 * 256 * len(optimizer.lows)
    for phase in ("sampling", "logprobs", "backward"):
        assert kept.total(phase) - moved.total(phase) == params * 6
        assert "moments" not in moved.phases[phase] and "master low halves" not in moved.phases[phase]
    largest = max(p.numel() for p in model.parameters())  # the embedding here: 97 × 64
    assert moved.phases["optimizer step"]["optimizer staging"] == 2 * largest * 6
    # LoRA and FSDP2 keep their state as before: the option is for one process training every weight
    lora = replace(step, offload_optimizer=True, lora_rank=4)
    assert training_memory_plan(TINY, lora).host == {}
    assert "optimizer state" not in training_memory_plan(TINY, replace(step, offload_optimizer=True),
                                                         RankShape(ranks=2, fsdp=True)).host


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_sharded_terms_are_the_shard_optimizer_s_split_over_the_ranks(moment_dtype):
    """FSDP2 trains an fp32 copy: its weights and the moments of the optimizer `make_optimizer` builds over it (torch's
    AdamW with fp32 moments, `ShardedAdamW` with bf16 ones), over N ranks, are the plan's."""
    model = CausalLM(TINY)  # fp32, as `_fully_shard` widens it
    optimizer = (torch.optim.AdamW(model.parameters()) if moment_dtype == "float32"
                 else ShardedAdamW(model.parameters(), state_dtype=torch.bfloat16))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    moments = tensor_bytes(t for state in optimizer.state.values() for name, t in state.items()
                           if name.startswith("exp_avg"))
    step = StepShape(rows=8, group=4, prompt_len=8, completion_len=8, micro_rows=4,
                     moment_bytes=8 if moment_dtype == "float32" else 4)
    for ranks in (2, 4):
        terms = training_memory_plan(TINY, step, RankShape(ranks=ranks, fsdp=True, sampling_split=ranks)).phases
        assert terms["sampling"]["fp32 master shard"] == -(-tensor_bytes(model.parameters()) // ranks)
        assert terms["sampling"]["moments"] == -(-moments // ranks)
        assert terms["sampling"]["engine weights"] == -(-tensor_bytes(model.parameters()) // 2 // ranks)  # bf16
        assert terms["optimizer step"]["gradients"] == terms["sampling"]["fp32 master shard"]
        assert terms["setup"]["fp32 shards"] == terms["sampling"]["fp32 master shard"]  # no whole fp32 copy
        assert "optimizer temporary" not in terms["optimizer step"]  # torch's fused AdamW, or slices of a tensor
        chunk = terms["optimizer step"].get("optimizer chunk", 0)
        assert chunk == (CHUNK_ELEMENTS * SCRATCH_BYTES_PER_ELEMENT if moment_dtype == "bfloat16" else 0)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_ddp_rank_holds_its_gradients_and_buckets_beside_the_kv_cache(ranks):
    """DDP: each rank holds what one GPU does, and in the backward and the optimizer step its bf16 gradients and
    DDP's buckets (a second copy), each parameters × 2 bytes, beside the whole KV cache: only one process lends the
    idle cache to the gradients (`memory/manager.py`), so a DDP rank borrows none of it."""
    model = CausalLM(TINY).to(torch.bfloat16)
    weights = tensor_bytes(model.parameters())
    step = StepShape(rows=8, group=4, prompt_len=8, completion_len=8, micro_rows=4)  # lend_kv_cache: the default
    one_gpu, ddp = training_memory_plan(TINY, step), training_memory_plan(TINY, step, RankShape(ranks=ranks))
    kv = engine_kv_bytes(TINY, step, 1)
    assert kv > weights  # a cache that could take the gradients whole: one GPU's plan lends it
    assert one_gpu.phases["backward"]["gradients"] == 0 and "DDP buckets" not in one_gpu.phases["backward"]
    sampling = ddp.phases["sampling"]
    assert sampling == one_gpu.phases["sampling"]
    assert (sampling["weights"], sampling["master low halves"], sampling["KV cache"]) == (weights, weights, kv)
    assert sampling["moments"] == 2 * weights  # AdamW's two moments in bf16
    for phase in ("backward", "optimizer step"):
        terms = ddp.phases[phase]
        assert (terms["gradients"], terms["DDP buckets"], terms["KV cache"]) == (weights, weights, kv), phase
    # the optimizer step is what stays through the step, the gradients and the buckets: nothing else
    assert ddp.total("optimizer step") == ddp.total("sampling") + 2 * weights
    backward = {name: size for name, size in ddp.phases["backward"].items() if name not in sampling}
    one_gpu_backward = {name: size for name, size in one_gpu.phases["backward"].items() if name not in sampling}
    assert backward == {**one_gpu_backward, "gradients": weights, "DDP buckets": weights}


def test_lora_adapters_are_peft_s():
    from cohort_grpo.models.lora import apply_lora, lora_config_from_args

    model = CausalLM(TINY)
    apply_lora(model, lora_config_from_args(GRPOConfig(use_peft=True, lora_r=4).validate()))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameter_count(TINY, 4) == trained


def test_the_kv_cache_is_the_engines():
    """The engine's cache after a call of 6 sequences with 5-token prompts and 20 new tokens (a 128-token row)."""
    torch.manual_seed(0)
    model = CausalLM(TINY).eval()
    engine = Engine(model, use_cuda_graph=False, compile_kernels=False)
    engine.generate([[1, 2, 3, 4, 5]] * 3, 2, SamplingParams(max_new_tokens=20, pad_token_id=0, seed=0))
    cache = tensor_bytes(engine.cache.k_layers + engine.cache.v_layers)
    step = StepShape(rows=6, group=2, prompt_len=5, completion_len=20, micro_rows=6, dtype="float32")
    assert engine_kv_bytes(TINY, step, 1) == cache
    assert engine_kv_bytes(TINY, step, 2) == cache  # a group of 2 samples 12 rows, half the heads each


def test_the_recurrent_states_are_the_engines():
    """A model with Gated DeltaNet layers (Qwen3.5's): the engine's states after a call of 6 sequences are the
    plan's term for them, priced from the config alone, and the plan holds them while sampling, not after a
    release of the sampling memory."""
    import transformers

    from cohort_grpo.models.generic import TransformersCausalLM
    from cohort_grpo.models.recurrent_state import row_bytes
    from test_sampling_plan import linear_attention_state_shapes
    from cohort_grpo.plans.training_plan import engine_state_bytes

    config = transformers.Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=97, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = TransformersCausalLM.wrap(transformers.Qwen3_5ForCausalLM(config).eval())
    engine = Engine(model, use_cuda_graph=False, compile_kernels=False)
    engine.generate([[1, 2, 3, 4, 5]] * 3, 2, SamplingParams(max_new_tokens=20, pad_token_id=0, seed=0))
    allocated = tensor_bytes(engine.cache.recurrent.tensors.values())
    state_bytes = row_bytes(linear_attention_state_shapes(config, torch.float32), torch.float32)
    step = StepShape(rows=6, group=2, prompt_len=5, completion_len=20, micro_rows=6, dtype="float32",
                     state_bytes=state_bytes)
    assert engine_state_bytes(step, 1) == allocated == 6 * 2 * (128 * 4 * 4 + 4 * 16 * 16 * 4)
    plan = training_memory_plan(TINY, step)
    assert plan.phases["sampling"]["recurrent states"] == allocated
    assert plan.phases["backward"]["recurrent states"] == allocated  # kept between rollouts, like the KV cache
    released = training_memory_plan(TINY, replace(step, free_sampling_memory=True))
    assert "recurrent states" not in released.phases["backward"]
    assert "recurrent states" not in training_memory_plan(TINY, replace(step, state_bytes=0)).phases["sampling"]


@pytest.mark.parametrize("micro_rows, cap", [(8, 0), (8, 100), (2, 0), (3, 40), (16, 1000)])
def test_the_largest_micro_batch_is_the_packers(micro_rows, cap):
    """Every completion at full length: the packer's largest micro-batch (padded tokens, prompts shared)."""
    group, prompt_len, completion_len, prompts = 4, 6, 10, 4
    prompt_ids = [[p] * prompt_len for p in range(prompts) for _ in range(group)]
    mask = torch.ones(len(prompt_ids), completion_len)
    plans = Layout(shared=True, group=group).plan(prompt_ids, mask, micro_rows, cap)

    def padded(rows):  # units (prompt groups) × the longest unit, as the packer budgets them
        units = {}
        for row in rows:
            units.setdefault(tuple(prompt_ids[row]), []).append(row)
        return len(units) * max(prompt_len + len(r) * completion_len for r in units.values())

    step = StepShape(rows=len(prompt_ids), group=group, prompt_len=prompt_len, completion_len=completion_len,
                     micro_rows=micro_rows, micro_tokens=cap)
    assert micro_batch_tokens(TINY, step) == max(padded(rows) for rows in plans)


def one_gpu(args) -> Placement:
    return Placement.from_config(args, 1)


def step_of(args, world_size: int = 1) -> StepShape:
    """The step of the run `args` (validated) on `world_size` processes."""
    return StepShape.from_config(args, Placement.from_config(args, world_size))


@pytest.mark.parametrize("share", [True, False])
def test_the_plan_lays_the_step_out_as_the_run_does(share):
    """Each prompt once for its G completions where asked and G > 1, with our models (the plan's); a model
    without attention rows always gets one padded row per completion."""
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=4, share_prompt_prefix=share).validate()
    layout = step_of(args).layout
    assert layout == Layout.choose(args.share_prompt_prefix, args.num_generations)
    assert layout.shared == share and layout.group == 4
    assert not Layout.choose(share, 4, takes_attention_rows=False).shared
    assert not Layout.choose(share, 1).shared  # one completion a prompt: nothing to share


def test_the_plan_follows_the_options():
    step = step_of(GRPOConfig(max_completion_length=4096, per_device_train_batch_size=4,
                              gradient_accumulation_steps=8, beta=0.04).validate())
    assert (step.rows, step.micro_rows, step.reference, step.moment_bytes) == (32, 4, True, 4)
    config = ModelConfig(**LLAMA_8B)
    one = training_memory_plan(config, step)
    assert "π_ref" not in one.phases["sampling"] and one.phases["logprobs"]["π_ref"] == 2 * one.parameters  # offloaded
    assert training_memory_plan(config, step_of(GRPOConfig(
        offload_ref_model=False, beta=0.04).validate())).phases["sampling"]["π_ref"] == 2 * one.parameters
    freed = training_memory_plan(config, StepShape(**{**vars(step), "free_sampling_memory": True}))
    assert freed.phases["backward"]["KV cache"] == 0 < freed.phases["sampling"]["KV cache"]
    lent = one.phases["backward"]["gradients"]
    assert lent == max(0, 2 * one.parameters - one.phases["sampling"]["KV cache"])  # borrowed from the idle cache


@pytest.mark.parametrize("world, options, copies", [
    (1, dict(), True),  # one process: the producer thread samples on a copy of its own
    (2, dict(), True),  # DDP alike
    (2, dict(fsdp=True, max_staleness=2), True),  # FSDP2 two updates behind: the copy keeps the older weights
    (2, dict(fsdp=True, max_staleness=1), False),  # FSDP2: on the engine's own copy, refreshed in place
    (2, dict(fsdp=True), False),  # max_staleness None: 1 once the run resolves it
    (2, dict(fsdp=True, max_staleness=1, rollout_tensor_parallel_size=2), False),  # on the rank's shard
    (2, dict(rollout_gpus=1), False)])  # on ranks of their own
def test_asynchronous_rollouts_price_a_producer_copy_only_where_it_exists(world, options, copies):
    step = step_of(GRPOConfig(async_rollouts=True, **options).validate(), world)
    plan = training_memory_plan(ModelConfig(**LLAMA_8B), step)
    assert step.async_copy is copies
    assert ("sampler copy" in plan.phases["sampling"]) is copies


# ---- the refusal ---------------------------------------------------------------------------------------------

@pytest.fixture
def gpu(monkeypatch):
    """A GPU with `gpu.gib` GiB free as far as the capacity check can tell."""
    state = SimpleNamespace(gib=80.0, host_gib=16.0)
    monkeypatch.setattr(capacity, "host_memory_available", lambda: int(state.host_gib * GIB))
    monkeypatch.setattr(capacity.torch.cuda, "mem_get_info", lambda device: (int(state.gib * GIB), 0))
    monkeypatch.setattr(capacity.torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(capacity.torch.cuda, "memory_allocated", lambda device: 0)
    return state


@pytest.fixture
def llama_8b_folder(tmp_path):
    """A model folder with only its config.json: loading it would fail, so a refusal proves nothing loaded."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    return tmp_path


CUDA = torch.device("cuda", 0)


def test_a_run_that_cannot_fit_is_refused_with_what_would(gpu, llama_8b_folder):
    args = GRPOConfig(model=str(llama_8b_folder), max_completion_length=4096, per_device_train_batch_size=8,
                      gradient_accumulation_steps=8).validate()
    with pytest.raises(CohortError) as refused:
        check_capacity(str(llama_8b_folder), args, one_gpu(args), CUDA)
    line = str(refused.value)
    assert "\n" not in line
    assert re.search(r"full-parameter GRPO of this 8\.0B-parameter llama model on one GPU needs about \d+\.\d GiB "
                     r"a GPU \(backward .*\), more than the 80\.0 GiB free on cuda:0", line), line
    assert re.search(r"fsdp[= ](true|True) under --nproc_per_node \d+", line)
    assert re.search(r"use_peft[= ](true|True)", line)
    assert re.search(r"a smaller step \((--)?per_device_train_batch_size[= ]1", line)
    # each suggestion fits where the run did not
    gpus = int(re.search(r"(\d+) GPUs with FSDP2", line).group(1))
    # max_concurrent_sequences=auto: the engine's slots are sized after loading, to what the step leaves (one at least)
    step = replace(step_of(args), engine_slots=1)
    fsdp = GRPOConfig(fsdp=True).validate()
    assert training_memory_plan(ModelConfig(**LLAMA_8B), step, RankShape.of(
        Placement.from_config(fsdp, gpus))).peak <= 80 * GIB
    assert training_memory_plan(ModelConfig(**LLAMA_8B), step, RankShape.of(
        Placement.from_config(fsdp, gpus - 1))).peak > 80 * GIB


def test_auto_keeps_the_optimizer_state_in_host_memory_where_only_that_fits(gpu, llama_8b_folder):
    """Llama-3.1-8B, full parameters, 32 completions of 4K tokens on one 80 GB card: with the state on the GPU the
    engine cannot decode them all at once, with the state in host memory it can; auto takes it where the host has
    the memory, and the refusal offers it where it is off."""
    options = dict(max_completion_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=32)
    args = GRPOConfig(**options).validate()
    config, whole = ModelConfig(**LLAMA_8B), step_of(args)  # every completion decoded at once
    assert training_memory_plan(config, whole).peak > 80 * GIB
    assert training_memory_plan(config, replace(whole, engine_slots=1)).peak < 80 * GIB  # a one-slot engine fits
    gpu.host_gib = 100.0
    plan = check_capacity(str(llama_8b_folder), args, one_gpu(args), CUDA)
    params = plan.parameters
    assert plan.step.offload_optimizer and plan.host == {"optimizer state": params * 6}
    assert training_memory_plan(config, replace(whole, offload_optimizer=True)).peak < 80 * GIB  # and decodes all
    gpu.gib = 60.0  # a card where the state does not fit at all, even beside a one-slot engine
    off = GRPOConfig(**options, offload_optimizer=False).validate()
    with pytest.raises(CohortError, match=r"what would fit: AdamW's state in host memory \((--)?offload_optimizer[= ](true|True)\)"):
        check_capacity(str(llama_8b_folder), off, one_gpu(off), CUDA)
    gpu.host_gib = 40.0  # the 44.9 GiB of state cannot wait on this host: auto keeps it off, and nothing offers it
    with pytest.raises(CohortError) as refused:
        check_capacity(str(llama_8b_folder), args, one_gpu(args), CUDA)
    assert "offload_optimizer" not in str(refused.value) and "use_peft" in str(refused.value)
    asked = GRPOConfig(**options, offload_optimizer=True).validate()  # asked for: refused for the host's sake
    with pytest.raises(CohortError, match=r"offload_optimizer keeps 44\.9 GiB in host memory \(optimizer state "
                                          r"44\.9\), more than the 40\.0 GiB available"):
        check_capacity(str(llama_8b_folder), asked, one_gpu(asked), CUDA)


def test_a_run_whose_engine_can_decode_fewer_sequences_at_once_is_not_refused(gpu, llama_8b_folder):
    """The plan with all of a step's completions decoded at once exceeds the card, one slot's does not: `auto`
    slots will shrink to fit, so the run goes on; an explicit slot count is held to."""
    options = dict(max_completion_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=64,
                   use_peft=True)
    args = GRPOConfig(**options).validate()
    step = step_of(args)
    config = ModelConfig(**LLAMA_8B)
    whole, one = (training_memory_plan(config, replace(step, engine_slots=n)).peak for n in (64, 1))
    gpu.gib = (whole + one) / 2 / GIB
    assert check_capacity(str(llama_8b_folder), args, one_gpu(args), CUDA).peak == one
    asked = GRPOConfig(**options, max_concurrent_sequences=64).validate()
    with pytest.raises(CohortError, match="LoRA GRPO"):
        check_capacity(str(llama_8b_folder), asked, one_gpu(asked), CUDA)


def test_a_run_that_fits_is_not_refused(gpu, llama_8b_folder):
    args = GRPOConfig(max_completion_length=512, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      use_peft=True).validate()
    plan = check_capacity(str(llama_8b_folder), args, one_gpu(args), CUDA)
    assert plan is not None and plan.peak < 80 * GIB
    gpu.gib = 1.0  # the same run on a 1 GiB card
    with pytest.raises(CohortError, match="LoRA GRPO"):
        check_capacity(str(llama_8b_folder), args, one_gpu(args), CUDA)


def test_nothing_is_planned_off_cuda_or_without_a_config(gpu, llama_8b_folder, tmp_path):
    gpu.gib = 0.001
    big = GRPOConfig(max_completion_length=4096).validate()
    assert check_capacity(str(llama_8b_folder), big, one_gpu(big), torch.device("cpu")) is None
    assert check_capacity(None, big, one_gpu(big), CUDA) is None  # the built-in model
    assert check_capacity(CausalLM(TINY), big, one_gpu(big), CUDA) is None  # a model object is already loaded
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**LLAMA_8B, "model_type": "gpt2"}))
    assert config_before_loading(tmp_path / "other") is None  # transformers' model: not this plan's


def test_cohort_train_stops_before_loading(gpu, llama_8b_folder, tmp_path, monkeypatch):
    """Through the trainer: the refusal comes before the loader is called; a fitting run reaches the loader."""
    from cohort_grpo import GRPOTrainer
    from cohort_grpo.run import start
    from cohort_grpo.parallel.distributed import Parallel

    monkeypatch.setattr(Parallel, "from_env", classmethod(lambda cls, *a, **k: Parallel(device=CUDA)))
    loads = []

    def loader(*args, **kwargs):
        loads.append(args[0])
        raise RuntimeError("loading")

    monkeypatch.setattr(start, "load_run_policy", loader)  # the start-up both kinds of rank share
    rows = [{"prompt": "1+1="}] * 8
    big = GRPOConfig(output_dir=str(tmp_path / "run"), max_completion_length=4096, per_device_train_batch_size=8,
                     gradient_accumulation_steps=8)
    with pytest.raises(CohortError, match=r"needs about .* GiB a GPU"):
        GRPOTrainer(str(llama_8b_folder), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    train_dataset=rows, args=big)
    assert loads == []
    small = GRPOConfig(output_dir=str(tmp_path / "run2"), max_completion_length=256, per_device_train_batch_size=2,
                       gradient_accumulation_steps=1, num_generations=2, use_peft=True)
    with pytest.raises(RuntimeError, match="loading"):
        GRPOTrainer(str(llama_8b_folder), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    train_dataset=rows, args=small)
    assert loads == [str(llama_8b_folder)]


def test_the_plan_meets_the_measured_fsdp2_peak():
    """docs/performance.md: FSDP2 over 4 H200s, Qwen2.5-7B shape, 16 prompts × 4 of 128 tokens (64-token prompts,
    8-row micro-batches, β = 0, DDP's default whole engine copy): the busiest GPU peaked at 69.4 GiB, measured
    while FSDP2 accumulated unsharded fp32 gradients between micro-batches and stepped torch's foreach AdamW."""
    qwen_7b = ModelConfig(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                          num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128)
    args = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
                      max_prompt_length=64, max_completion_length=128, fsdp=True,
                      optimizer_state_dtype="float32").validate()  # the moments were fp32 on the shard then
    measured = RankShape(ranks=4, fsdp=True, sync_every_micro_batch=False, optimizer_temporary=True,
                          widen_after_sharding=False)
    plan = training_memory_plan(qwen_7b, step_of(args, 4), measured)
    assert plan.peak_phase == "backward" and abs(plan.peak / GIB - 69.4) < 0.05 * 69.4
    synced = training_memory_plan(qwen_7b, step_of(args, 4), replace(measured, sync_every_micro_batch=True))
    unsharded, shard = 4 * plan.parameters, -(-4 * plan.parameters // 4)  # fp32 gradients, whole and a rank's
    assert plan.total("backward") - synced.total("backward") == unsharded - shard


@pytest.mark.parametrize("config, measured_bytes", [
    # Qwen2.5-1.5B's shape: 75 KB a token (docs: the module's docstring)
    (ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, head_dim=128), 75_000),
    # a Qwen3-MoE of 64 experts, top 8 (bench's qwen3-moe-1b-7b): 1.57 GiB a kept layer at 11,264 tokens
    (ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64,
                 num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=True), 1.57 * GIB / 11_264),
], ids=["qwen2.5-1.5b", "qwen3-moe-1b-7b"])
def test_a_kept_layer_s_activations_meet_the_probe_s_measurement(config, measured_bytes):
    """What `checkpointed_layers.ActivationProbe` measured a kept compiled layer to hold per token, bf16, on an H200:
    the plan's estimate is within 10% for a dense layer and for a mixture of experts' (whose k copies of each token
    are most of it: the dense formula would say 63.5 KB there)."""
    assert abs(activation_bytes_per_token(config, 2) / measured_bytes - 1) < 0.10


def test_a_model_with_dense_and_sparse_layers_keeps_each_layer_s_activations():
    config = ModelConfig(model_type="qwen3_moe", vocab_size=97, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])
    attention = 4 * 64 + 2 * 64 + 2 * 32
    dense, sparse = 2 * (attention + 3 * 96), 2 * (attention + 2 * (2 * 64 + 3 * 32)) + 4 * 8
    step = StepShape(rows=4, group=4, prompt_len=8, completion_len=8, micro_rows=4, checkpointing=False)
    tokens = micro_batch_tokens(config, step)
    assert training_memory_plan(config, step).phases["backward"]["activations"] == tokens * (2 * sparse + dense)
    assert activation_bytes_per_token(config, 2) == sparse


@pytest.mark.parametrize("dtype, offloads", [("bfloat16", True), ("auto", True), ("float16", False),
                                             ("float32", False)])
def test_only_weights_with_split_masters_are_planned_with_their_state_in_host_memory(dtype, offloads):
    """The one rule of `run/resolve.py` (`holds_split_masters`: bf16, which `auto` is on a GPU): a float16 step
    asked to offload keeps its state on the GPU in the plan, and the plan never offers --offload_optimizer true
    for it; float16 and bfloat16 weights weigh the same."""
    from cohort_grpo.plans.capacity import fitting_alternatives
    from cohort_grpo.plans.training_plan import offloaded

    step = replace(step_of(GRPOConfig(dtype=dtype, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                                      num_generations=4).validate()), offload_optimizer=True)
    assert step.element_bytes == (4 if dtype == "float32" else 2)
    assert offloaded(step, RankShape()) is offloads
    on_gpu = training_memory_plan(TINY, replace(step, offload_optimizer=False))
    asked = training_memory_plan(TINY, step)
    assert (asked.peak < on_gpu.peak) is offloads
    offered = fitting_alternatives(TINY, replace(step, offload_optimizer=False), RankShape(), asked.peak)
    assert any("--offload_optimizer true" in line for line in offered) is offloads
