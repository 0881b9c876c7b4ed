"""One measured run of bench/grpo_step.py, in its own process (fresh CUDA memory statistics).

    python bench/grpo_step_worker.py SPEC.json RESULT.json

SPEC["kind"] is one of
- "build":  a random-init Qwen2.5-shaped model folder (bf16 safetensors) with the synthetic
            word-level tokenizer of ../shared/bench/trl_baseline.py (EOS = t{V-1}, pad = t{V-2});
- "trl":    TRL's GRPOTrainer configured as trl_baseline.py, on that folder;
- "cohort": cohort's GRPOTrainer on that folder, or on a model built directly on the device
            (SPEC["source"] == "module": no safetensors written), with LoRA when SPEC["lora"] is set
            (TRL's way: GRPOTrainer(peft_config=LoraConfig(...))).
A vision-language shape (SHAPES["qwen2.5-vl-3b"]) runs the same kinds in grpo_step_vision.py, with images.
RESULT.json is rewritten after every step, so a run killed by the time budget still leaves the
steps it finished. Every number is measured here; the driver only tabulates.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cohort from this checkout

# Model shapes (their config.json), random weights: Qwen2.5 (by size; 14B and 32B for the capacity rows of
# bench/scale.py), Llama-3.1-8B and Qwen3-8B (the dense rows of NeMo-RL's performance summary), two Qwen3-MoE
# shapes. `SMOKE` replaces them with tiny ones of the same families for the CPU
# check. Llama-3.1's rope scaling (llama3) is left out: it changes the positions' angles, not the step's cost.
def _shape(hidden: int, inner: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
           model_type: str = "qwen2", **extra) -> dict:
    return dict(model_type=model_type, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tied,
                **extra)


SHAPES = {
    "0.5b": _shape(896, 4864, 24, 14, 2, 151936, True),
    "1.5b": _shape(1536, 8960, 28, 12, 2, 151936, True),
    "3b": _shape(2048, 11008, 36, 16, 2, 151936, True),
    "7b": _shape(3584, 18944, 28, 28, 4, 152064, False),
    "llama3.1-8b": _shape(4096, 14336, 32, 32, 8, 128256, False, "llama", rope_theta=500000.0,
                          max_position_embeddings=131072),
    "qwen3-8b": _shape(4096, 12288, 36, 32, 8, 151936, False, "qwen3", head_dim=128, max_position_embeddings=40960),
    "qwen2.5-14b": _shape(5120, 13824, 48, 40, 8, 152064, False),
    "qwen2.5-32b": _shape(5120, 27648, 64, 40, 8, 152064, False),
    # Mixtures of experts (Qwen3-MoE): one of OLMoE-1B-7B's size (16 layers, 64 experts, top 8), and
    # Qwen3-30B-A3B with half its 48 layers for 2 cards, and whole (full-parameter training needs 4 cards).
    "qwen3-moe-1b-7b": _shape(2048, 6144, 16, 16, 4, 151936, False, "qwen3_moe", head_dim=128, num_experts=64,
                              num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=True),
    "qwen3-30b-a3b-half": _shape(2048, 6144, 24, 32, 4, 151936, False, "qwen3_moe", head_dim=128, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                                 max_position_embeddings=40960),
    "qwen3-30b-a3b": _shape(2048, 6144, 48, 32, 4, 151936, False, "qwen3_moe", head_dim=128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                            max_position_embeddings=40960),
}
SMOKE = {
    "0.5b": _shape(64, 128, 2, 4, 2, 1000, True),
    "1.5b": _shape(96, 192, 2, 4, 2, 1000, True),
    "3b": _shape(128, 256, 2, 4, 2, 1000, True),
    "7b": _shape(128, 256, 3, 4, 2, 1000, False),
    "llama3.1-8b": _shape(64, 128, 2, 4, 2, 1000, False, "llama", rope_theta=500000.0),
    "qwen3-8b": _shape(64, 128, 2, 4, 2, 1000, False, "qwen3", head_dim=16),
    "qwen2.5-14b": _shape(80, 160, 3, 4, 2, 1000, False),
    "qwen2.5-32b": _shape(80, 320, 4, 4, 2, 1000, False),
    "qwen3-moe-1b-7b": _shape(64, 128, 2, 4, 2, 1000, False, "qwen3_moe", head_dim=16, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3-30b-a3b-half": _shape(64, 128, 2, 4, 2, 1000, False, "qwen3_moe", head_dim=16, num_experts=16,
                                 num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True),
    "qwen3-30b-a3b": _shape(64, 128, 4, 4, 2, 1000, False, "qwen3_moe", head_dim=16, num_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=16, norm_topk_prob=True),
}


def _vision_shape(text: dict, vision: dict, image_side: int) -> dict:
    """A Qwen2.5-VL shape: its language tower (`_shape`'s fields), its vision tower, and the side of each prompt's
    square image in pixels."""
    return dict(model_type="qwen2_5_vl", vocab_size=text["vocab_size"], tie_word_embeddings=text.pop(
        "tie_word_embeddings"), text_config={k: v for k, v in text.items() if k != "model_type"},
        vision_config=vision, image_side=image_side)


# Qwen/Qwen2.5-VL-3B-Instruct's config.json: the language tower is the 3b shape above (rope theta 1e6, multimodal
# rotary sections 16/24/24 of the 64 frequency pairs), the vision tower 32 blocks of width 1280 (MLP 3420, 16
# heads), windowed attention (112-pixel windows) but in blocks 7, 15, 23 and 31, its merger out to 2048.
SHAPES["qwen2.5-vl-3b"] = _vision_shape(
    _shape(2048, 11008, 36, 16, 2, 151936, True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=128000,
           rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
    dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_chans=3, out_hidden_size=2048,
         patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, tokens_per_second=2,
         fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
    image_side=448)
SMOKE["qwen2.5-vl-3b"] = _vision_shape(
    _shape(64, 128, 2, 4, 2, 1000, True, max_position_embeddings=4096,
           rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
    dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
         spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
    image_side=56)
COMMON = dict(max_position_embeddings=32768, rope_theta=1e6)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BETA, LEARNING_RATE = 0.04, 1e-6
# TRL 1.16's GRPOConfig default; the loss normalisation costs the same in any variant.
LOSS_TYPE = "dapo"


# ---- the shared inputs: tokenizer, prompts, reward -----------------------------------------

def make_tokenizer(vocab: int):
    """trl_baseline.py's tokenizer: word 't<i>' is token i, whitespace-split, EOS t{V-1}, pad t{V-2}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{vocab - 1}", pad_token=f"t{vocab - 2}",
                                   unk_token="t0")


def make_prompts(vocab: int, rows: int, length: int) -> list[dict]:
    """trl_baseline.py's dataset: `rows` prompts of `length` random words (= tokens), never EOS or pad."""
    rng = random.Random(0)
    return [{"prompt": " ".join(f"t{rng.randrange(vocab - 2)}" for _ in range(length))} for _ in range(rows)]


def make_reward(completion_len: int):
    def reward_distinct(completions, **kwargs):
        """trl_baseline.py's reward: the fraction of distinct words over the completion budget."""
        return [len(set(c.split())) / float(completion_len) for c in completions]

    return reward_distinct


def config_dict(shape: dict) -> dict:
    """The shape as a config.json's fields (COMMON's defaults where the shape sets none)."""
    vocab = shape["vocab_size"]
    return {**COMMON, **shape, "eos_token_id": vocab - 1, "pad_token_id": vocab - 2}


def layer_projections(shape: dict) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each matrix product of a decoder layer of `shape`, q/k/v and gate/up fused
    as the engine runs them."""
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    head_dim = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inner, hidden), "down": (hidden, inner)}


def hf_config(shape: dict):
    from transformers import AutoConfig

    fields = config_dict(shape)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# ---- measurement helpers -----------------------------------------------------------------------

class Recorder:
    """The result dict, rewritten to disk after every change (a killed run keeps what it measured)."""

    def __init__(self, path: str, spec: dict):
        self.path = Path(path)
        self.cuda = spec["device"] == "cuda"
        self.peak_bytes = 0
        self.result = dict(kind=spec["kind"], label=spec.get("label"), status="running", notes=[],
                           torch=torch.__version__)
        if self.cuda:
            self.result["device"] = torch.cuda.get_device_name()

    def observe_peak(self) -> None:
        """Fold the peak since the last reset into the process peak (cohort resets it every step)."""
        if self.cuda:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())
            self.result["peak_gib"] = round(self.peak_bytes / 2**30, 2)

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.result["notes"].append(text)

    def save(self, **fields) -> None:
        self.result.update(fields)
        self.observe_peak()
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.result, indent=1, default=str))
        partial.replace(self.path)  # atomic: a worker killed mid-write leaves the previous record whole


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def steady(values: list[float]) -> float | None:
    """Mean of the steps after the first (the first pays compilation, graph capture, allocator warm-up)."""
    rest = [v for v in values[1:] if v is not None]
    return sum(rest) / len(rest) if rest else None


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


# ---- kind: build -------------------------------------------------------------------------------

def built_in_bf16(factory, device: str):
    """`factory()`'s random-init model, seeded (0) and initialised on `device` in bf16."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = factory()
    finally:
        torch.set_default_dtype(default)
    return model.to(torch.bfloat16)


def run_build(spec: dict, rec: Recorder) -> None:
    """A random-init transformers model of the shape's family saved as bf16 safetensors + the tokenizer, as trl_baseline.py.
    Initialised on the device in bf16 (trl_baseline.py: fp32 on the CPU, then cast): the same
    N(0, 0.02) weights in distribution, and seconds instead of minutes for the 1.5B shape."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = built_in_bf16(lambda: AutoModelForCausalLM.from_config(hf_config(spec["shape"])), spec["device"])
    model.save_pretrained(spec["folder"])
    make_tokenizer(spec["shape"]["vocab_size"]).save_pretrained(spec["folder"])
    import transformers

    rec.save(status="ok", parameters=sum(p.numel() for p in model.parameters()), transformers=transformers.__version__,
             seconds=round(time.perf_counter() - started, 1))


# ---- kind: trl ---------------------------------------------------------------------------------

def run_trl(spec: dict, rec: Recorder) -> None:
    """TRL 1.16 GRPOTrainer exactly as trl_baseline.py configures it (output_dir, max_steps and the
    progress bar aside); per-step wall time from a callback around each optimizer step."""
    from datasets import Dataset
    import trl
    from trl import GRPOConfig, GRPOTrainer

    device, run = spec["device"], spec["run"]
    vocab = spec["shape"]["vocab_size"]
    timer = trl_step_timer(device, rec)
    rec.save(trl=trl.__version__)
    dataset = Dataset.from_list(make_prompts(vocab, run["rows"], run["prompt_len"]))
    bf16 = device == "cuda"  # CPU smoke: fp32 (bf16 autocast on a CPU proves nothing about the GPU run)
    if not bf16:
        rec.note("CPU: TRL runs with bf16=False")
    args = GRPOConfig(**trl_options(run, device, bf16))
    extra = {}
    if spec.get("lora"):  # TRL's LoRA: GRPOTrainer(peft_config=LoraConfig(...)), the adapters of cohort's run
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=spec["lora"]["r"], lora_alpha=spec["lora"]["alpha"],
                                          target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none")
        rec.save(lora=spec["lora"])
    started = time.perf_counter()
    trainer = GRPOTrainer(model=spec["folder"], reward_funcs=[make_reward(run["completion_len"])], args=args,
                          train_dataset=dataset, processing_class=make_tokenizer(vocab), callbacks=[timer], **extra)
    setup = time.perf_counter() - started
    trainer.train()
    trl_finish(rec, timer, setup, started)
    shutil.rmtree(args.output_dir, ignore_errors=True)  # save_strategy="no": nothing of value there


def trl_options(run: dict, device: str, bf16: bool) -> dict:
    """TRL's GRPOConfig fields of every TRL run (trl_baseline.py's)."""
    return dict(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=run["per_device"],
        gradient_accumulation_steps=run["grad_accum"], num_generations=run["generations"],
        max_completion_length=run["completion_len"], beta=BETA, learning_rate=LEARNING_RATE, bf16=bf16,
        logging_steps=1, max_steps=run["steps"], report_to=[], save_strategy="no", gradient_checkpointing=True,
        temperature=1.0, top_k=0, top_p=1.0, disable_tqdm=True, use_cpu=device == "cpu")


def trl_step_timer(device: str, rec: Recorder):
    """A TrainerCallback timing each optimizer step (recorded after every step) and keeping TRL's logs."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.log_records: list[dict] = []

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(device)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(device)
            self.times.append(time.perf_counter() - self.started)
            print(f"trl step {state.global_step}: {self.times[-1]:.2f} s", flush=True)
            rec.save(step_seconds=[round(t, 3) for t in self.times], steady_seconds=steady(self.times))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.log_records.append(numeric(logs))

    return StepTimer()


def trl_finish(rec: Recorder, timer, setup: float, started: float) -> None:
    last = next((r for r in reversed(timer.log_records) if "completions/mean_length" in r), {})  # not the summary log
    keep = ("completions/mean_length", "completions/clipped_ratio", "reward", "kl", "entropy", "loss")
    rec.save(status="ok", setup_seconds=round(setup, 1), total_seconds=round(time.perf_counter() - started, 1),
             last_log={k: v for k, v in last.items() if k in keep})


# ---- kind: cohort ------------------------------------------------------------------------------

@dataclasses.dataclass
class DiagnosisSetup:
    """What the one-process diagnosis scripts (profile_step.py, sampling_memory.py) run: the issue's
    batch on a random-init shape, or a tiny one on the CPU with --smoke."""

    device: str
    shape: dict
    prompts: int
    generations: int
    completion_len: int
    prompt_len: int
    tokenizer: object
    model: object


def diagnosis_setup(model_name: str, smoke: bool) -> DiagnosisSetup:
    device = "cpu" if smoke else "cuda"
    shape = (SMOKE if smoke else SHAPES)[model_name]
    prompts, generations, completion_len, prompt_len = (4, 4, 16, 16) if smoke else (32, 8, 512, 128)
    return DiagnosisSetup(device, shape, prompts, generations, completion_len, prompt_len,
                          make_tokenizer(shape["vocab_size"]), build_module(shape, device))


def build_module(shape: dict, device, group=None):
    """cohort's own CausalLM with random init, built directly on the device (bf16 on CUDA, as the
    stored folders are; fp32 on CPU, cohort's CPU default): no 15 GB of safetensors for a 7B shape.
    `group`: a torch.distributed group of T > 1 ranks, of which this rank builds only its tensor-parallel shard."""
    import torch.distributed as dist

    from cohort_grpo.models import CausalLM, ModelConfig
    from cohort_grpo.models.tensor_parallel import TensorParallelCausalLM

    config = ModelConfig.from_hf_dict(config_dict(shape))
    device = torch.device(device)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with device:
            if group is not None and dist.get_world_size(group) > 1:
                model = TensorParallelCausalLM(config, dist.get_rank(group), dist.get_world_size(group), group)
            else:
                model = CausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(device)


def unsaved_trainer():
    """cohort's GRPOTrainer minus checkpoints and the final save, for benches: a run's optimizer state is GBs of
    disk writes that no measured step includes (a 7B-total MoE's, 40 GB, fills the GPU machine's disk)."""
    from cohort_grpo import GRPOTrainer

    class UnsavedTrainer(GRPOTrainer):
        def save_checkpoint(self) -> Path:
            return Path(self.args.output_dir)  # nothing written

        def save_model(self, output_dir=None):
            return Path(output_dir or self.args.output_dir)

    return UnsavedTrainer


def cohort_config(spec: dict, rec: Recorder):
    """GRPOConfig for the run; new fields (max_tokens_per_micro_batch, LoRA) only where they exist."""
    from cohort_grpo import GRPOConfig

    run = spec["run"]
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    options = dict(
        output_dir=tempfile.mkdtemp(prefix="cohort-bench-"), per_device_train_batch_size=run["per_device"],
        gradient_accumulation_steps=run["grad_accum"], num_generations=run["generations"],
        max_prompt_length=run["prompt_len"], max_completion_length=run["completion_len"], beta=BETA,
        num_iterations=1, learning_rate=LEARNING_RATE, temperature=1.0, top_k=0, top_p=1.0, dtype="auto",
        max_steps=run["steps"], loss_type=LOSS_TYPE, eval_steps=0, save_steps=0, log_completions_steps=10**6, report_to="none", seed=0, device=spec["device"])
    if spec.get("gradient_checkpointing") is not None:  # else cohort's default
        options["gradient_checkpointing"] = spec["gradient_checkpointing"]
    if spec.get("micro_batch_tokens") is not None:
        if "max_tokens_per_micro_batch" in fields:
            options["max_tokens_per_micro_batch"] = spec["micro_batch_tokens"]
        else:
            rec.note("GRPOConfig has no max_tokens_per_micro_batch yet: --micro-batch-tokens ignored")
    for key, value in (spec.get("cohort_options") or {}).items():
        if key in fields:
            options[key] = value
        else:
            rec.note(f"--cohort-options: GRPOConfig has no field {key!r}: ignored")
    route = lora_route(fields) if spec.get("lora") else None
    if route == "config fields":
        lora = spec["lora"]
        options.update(use_peft=True, lora_r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                       lora_target_modules=LORA_TARGETS)
    unknown = [k for k in options if k not in fields]
    for key in unknown:
        rec.note(f"GRPOConfig has no field {key!r}: not set")
        options.pop(key)
    config = GRPOConfig(**options)
    if config.prompts_per_step != run["prompts"]:
        raise RuntimeError(f"cohort would sample {config.prompts_per_step} prompts per step, not {run['prompts']}")
    return config, route


def lora_route(config_fields) -> str:
    """How this cohort takes LoRA: TRL's GRPOTrainer(peft_config=LoraConfig), else the config fields
    (use_peft, lora_r, ...); neither: a RuntimeError, which ends the LoRA part only."""
    from cohort_grpo import GRPOTrainer

    if "peft_config" in inspect.signature(GRPOTrainer.__init__).parameters:
        return "peft_config argument"
    if "use_peft" in config_fields:
        return "config fields"
    raise RuntimeError("cohort's GRPOTrainer has neither peft_config= nor GRPOConfig.use_peft: no LoRA to measure")


def run_cohort(spec: dict, rec: Recorder) -> None:
    device, run = spec["device"], spec["run"]
    vocab = spec["shape"]["vocab_size"]
    tokenizer = make_tokenizer(vocab)
    rows = make_prompts(vocab, run["rows"], run["prompt_len"])
    lengths = {len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows[:8]}
    if lengths != {run["prompt_len"]}:
        raise RuntimeError(f"prompts tokenise to {sorted(lengths)} tokens, not {run['prompt_len']}")
    config, route = cohort_config(spec, rec)
    started = time.perf_counter()
    model = spec["folder"] if spec["source"] == "folder" else build_module(spec["shape"], device)
    trainer_options: dict = {}
    if route == "peft_config argument":
        from peft import LoraConfig

        trainer_options["peft_config"] = LoraConfig(r=spec["lora"]["r"], lora_alpha=spec["lora"]["alpha"],
                                                    target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none")
    if route:
        rec.save(lora_route=route)
    trainer = bench_trainer(rec)(model=model, reward_funcs=[make_reward(run["completion_len"])], train_dataset=rows,
                                 args=config, processing_class=tokenizer, **trainer_options)
    cohort_train(trainer, spec, rec, config, started)


def bench_trainer(rec: Recorder):
    """cohort's GRPOTrainer (unsaved) writing a record after every step."""

    class BenchTrainer(unsaved_trainer()):
        def log_step(self, batch, losses, seconds):
            rec.observe_peak()  # before the trainer's own metrics reset the CUDA peak
            super().log_step(batch, losses, seconds)
            step_peak = self.history[-1].get("peak_memory_gib")  # the largest of the step's phase peaks
            if step_peak is not None:
                rec.peak_bytes = max(rec.peak_bytes, int(step_peak * 2**30))
                rec.result["peak_gib"] = round(rec.peak_bytes / 2**30, 2)
            history = [numeric(r) for r in self.history]
            rec.save(history=history, **cohort_summary(history))  # complete after every step

    return BenchTrainer


def cohort_train(trainer, spec: dict, rec: Recorder, config, started: float) -> None:
    """Train the built trainer, recording its setup, model, optimizer and engine."""
    setup = time.perf_counter() - started
    describe_model(trainer, spec, rec)
    rec.save(setup_seconds=round(setup, 1), config={k: getattr(trainer.args, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations", "max_prompt_length",
        "max_completion_length", "beta", "loss_type", "dtype", "gradient_checkpointing", "torch_compile",
        "max_tokens_per_micro_batch")})  # as the trainer resolved them
    trainer.train()
    describe_optimizer(trainer, rec)
    engine = getattr(trainer, "sampler", None)
    rec.save(engine_graph_captures=getattr(getattr(engine, "graphs", None), "captures", None))
    rec.save(status="ok", total_seconds=round(time.perf_counter() - started, 1))
    shutil.rmtree(config.output_dir, ignore_errors=True)  # metrics.jsonl only: no checkpoint was written


def numeric(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def base_model(trainer):
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def describe_model(trainer, spec: dict, rec: Recorder) -> None:
    """Parameter counts and dtypes; turns gradient checkpointing on if asked and the trainer did not."""
    model, base = trainer.model, base_model(trainer)
    params = list(model.parameters())
    rec.save(parameters=sum(p.numel() for p in params), trainable=sum(p.numel() for p in params if p.requires_grad),
             param_dtype=str(params[0].dtype).removeprefix("torch."),
             reference_copy=getattr(trainer, "ref_model", None) is not None)
    if trainer.args.gradient_checkpointing and not getattr(base, "gradient_checkpointing", True):
        base.gradient_checkpointing_enable()
        rec.note("the trainer did not apply gradient_checkpointing=True to the model; the bench enabled it")
    rec.save(gradient_checkpointing=bool(getattr(base, "gradient_checkpointing", False)),
             torch_compile=bool(getattr(trainer.args, "torch_compile", False)),
             max_tokens_per_micro_batch=getattr(trainer.args, "max_tokens_per_micro_batch", None))


def describe_optimizer(trainer, rec: Recorder) -> None:
    """dtype of the tensors AdamW updates (fp32 = master weights) and of its moments."""
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is None:
        return
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    state = optimizer.state.get(first, {}) if first is not None else {}
    moment = state.get("exp_avg")
    rec.save(optimizer_param_dtype=str(first.dtype).removeprefix("torch.") if first is not None else None,
             optimizer_state_dtype=str(moment.dtype).removeprefix("torch.") if moment is not None else None,
             offload_optimizer=getattr(trainer.args, "offload_optimizer", None))
    try:  # how cohort keeps and steps the state, in its own words (where this cohort says it)
        from cohort_grpo.optim.optimizer import optimizer_line
        rec.save(optimizer_line=optimizer_line(optimizer))
    except ImportError:
        pass


def cohort_summary(history: list[dict]) -> dict:
    """Per-step wall times, steady-state means of the phase times / rates / MFU (and a MoE's routing/*), and the last
    step's micro-batching (count, OOM retries) from the trainer's own records."""
    keys = sorted({k for r in history for k in r
                   if k.startswith(("time/", "tokens_per_second/", "routing/")) or k == "mfu"})
    return dict(step_seconds=[round(r.get("step_time", float("nan")), 3) for r in history],
                steady_seconds=steady([r.get("step_time") for r in history]),
                steady={k: steady([r.get(k) for r in history]) for k in keys},
                # the sampler/trainer gap of every step (0 throughout under rollout_numerics=exact)
                sampling_logp_difference_max=[r.get("sampling/sampling_logp_difference/max") for r in history],
                micro_batch={k: v for k, v in (history[-1] if history else {}).items() if "micro" in k or "oom" in k})


# ---- entry point ---------------------------------------------------------------------------------

def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    rec = Recorder(result_path, spec)
    rec.save()
    try:
        import grpo_step_vision as vision  # beside this file; a vision-language shape's runs

        runs = {"build": run_build, "trl": run_trl, "cohort": run_cohort}
        if vision.is_vision(spec["shape"]):
            runs = {"build": vision.run_build, "trl": vision.run_trl, "cohort": vision.run_cohort}
        runs[spec["kind"]](spec, rec)
        return 0
    except Exception as error:  # noqa: BLE001 - the driver reports it; an OOM is a result, not a crash
        traceback.print_exc()
        oom = is_oom(error)
        rec.save(status="oom" if oom else "error", error=f"{type(error).__name__}: {error}"[:500])
        return 0 if oom else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
