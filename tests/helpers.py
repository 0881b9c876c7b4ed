"""Helpers several test modules share: tiny model configurations, small builders and synthetic batches.

Test modules import these from here, never from one another (a test module imported by another
would also run its import-time code there, and its tests would be tied to the importer's)."""

import torch
import transformers

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.trainer.grpo_trainer import Batch
from cohort_grpo.kernels import elementwise as kernels
from cohort_grpo.models import CausalLM, KVCache, ModelConfig
from cohort_grpo.rollout.sampler import Rollout

# ---- the engine's tiny transformers models (test_engine, test_engine_overlap) ---------------------

ENGINE_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                   initializer_range=0.2)  # large init: greedy outputs vary instead of repeating one token
ENGINE_FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
}


class CharTokenizer:
    """Token t decodes to a fixed piece of 1-3 letters, so stop strings can span tokens."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("abcdefghij"[t % 10] * (1 + t % 3) for t in ids)


# ---- the fused decode pieces' tiny cohort models (test_kernels, test_triton_decode_step) ----------

KERNEL_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
KERNEL_FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**KERNEL_TINY),
    "mistral_sliding": lambda: transformers.MistralConfig(**KERNEL_TINY, sliding_window=5),
    "qwen2_bias_tied": lambda: transformers.Qwen2Config(**KERNEL_TINY, tie_word_embeddings=True),
    "qwen2_sliding_layer": lambda: transformers.Qwen2Config(**KERNEL_TINY, use_sliding_window=True, sliding_window=4,
                                                            max_window_layers=1),
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(**KERNEL_TINY, head_dim=32),
}


def build_kernel_model(family: str, layers: int = 2) -> CausalLM:
    """A random-init model with every weight perturbed (so biases and norm weights matter) and its
    q/k/v and gate/up projections fused, as the engine runs it."""
    torch.manual_seed(0)
    config = KERNEL_FAMILIES[family]()
    config.num_hidden_layers = layers
    model = CausalLM(ModelConfig.from_hf_dict(config.to_dict())).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    model.fuse_projections()
    return model


def decode_run(model: CausalLM, ids: torch.Tensor, on: bool, compile: bool = True):
    """Prefill 5 tokens per row into cache rows 0..B-1 (unfused, as the engine does), then decode the
    rest one token at a time (default cache rows, as the engine's decode step) with fused kernels
    `on`. Returns (decode logits [B, steps, V], the cache)."""
    cache = KVCache.for_model(model, num_rows=ids.shape[0] + 1, max_len=32)
    logits = []
    with torch.inference_mode():
        model(ids[:, :5], kv_cache=cache, cache_rows=torch.arange(ids.shape[0]))
        for t in range(5, ids.shape[1]):
            positions = torch.full((ids.shape[0], 1), t)
            with kernels.fused_kernels(on, compile):
                logits.append(model(ids[:, t: t + 1], positions, kv_cache=cache, cache_len=16))
    return torch.cat(logits, dim=1), cache


# ---- a trainer and a synthetic rollout for update tests (test_update_memory, test_kept_layers) ----

UPDATE_PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


def variable_batch(vocab: int, seed: int = 0, rows: int = 9):
    """(prompt ids, completion ids [rows, T], mask [rows, T]) of random tokens: prompts of 2-6 tokens,
    completions of 1-8 tokens, right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(1, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(rows)]
    lengths = [int(n) for n in torch.randint(1, 9, (rows,), generator=g)]
    return (prompt_ids, *random_completions(lengths, vocab, g))


def random_completions(lengths: list[int], vocab: int, generator: torch.Generator):
    """(completion ids [rows, T], mask [rows, T]): row i holds `lengths[i]` random tokens in [1, vocab), right-padded
    with 0 to the longest."""
    width = max(lengths)
    completion = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        completion[i, :n] = torch.randint(1, vocab, (n,), generator=generator)
        mask[i, :n] = 1
    return completion, mask


def update_trainer(tiny_dir, tmp_path, **overrides) -> GRPOTrainer:
    """A trainer on the tiny model with β > 0 and no effective gradient clipping, for comparing updates."""
    base = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                max_completion_length=6, max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path), quiet=True,
                seed=0, max_grad_norm=1e9, beta=0.04)
    base.update(overrides)
    return GRPOTrainer(tiny_dir, always_one, UPDATE_PROMPTS, args=GRPOConfig(**base))


def synthetic_batch(trainer, seed=0) -> Batch:
    """16 random completions of random prompts with random advantages, and the reference
    log-probs the trainer computes for them."""
    prompt_ids, completion, mask = variable_batch(trainer.model.config.vocab_size, seed=seed, rows=16)
    rollout = Rollout(completion_ids=completion, completion_mask=mask, logprobs=None,
                      finish_reasons=["stop"] * 16)
    batch = Batch(rows=[{"prompt": "x"}] * 16, prompt_ids=prompt_ids, rollout=rollout, completions=[""] * 16)
    batch.advantages = torch.randn(16, generator=torch.Generator().manual_seed(seed))
    batch.old_logp, batch.ref_logp = trainer.reference_logprobs(batch)
    return batch


# A chat template in the Qwen2.5 layout for tools (written for the tests of tool calls and chat with tools).
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call functions.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls | default([]) %}{%- set f = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---- a tiny chat model that ends its turns early (environments' tests) ------------------------------------------

def save_chat_tiny(path, first_message: str) -> str:
    """The built-in tiny model with the tools chat template, saved to `path`, its end-of-turn embedding pointed at
    the mean hidden state of `first_message` so that turns end early. Returns the folder."""
    from cohort_grpo.models.tiny import TINY_TOOLS_TEMPLATE, build_model, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TINY_TOOLS_TEMPLATE
    model = build_model(tokenizer, seed=0)
    with torch.no_grad():
        ids = torch.tensor([tokenizer(first_message)["input_ids"]])
        hidden = model.model(ids).last_hidden_state[0].mean(0)
        model.model.embed_tokens.weight[tokenizer.eos_token_id] = 3.0 * hidden / hidden.norm()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def episode_config(tmp_path, **overrides) -> GRPOConfig:
    """Three short CPU steps of 2 prompts × 2 completions (environments' tests)."""
    return GRPOConfig(**dict(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                             max_completion_length=24, max_prompt_length=32, output_dir=str(tmp_path), quiet=True,
                             seed=0, device="cpu", eval_limit=0, logging_steps=1, save_steps=0, max_steps=3,
                             learning_rate=1e-4), **overrides)
