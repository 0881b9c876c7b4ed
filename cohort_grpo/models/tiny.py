"""The built-in default model: a tiny Llama with a character-level tokenizer.

`cohort-grpo train` with no arguments must run anywhere in minutes, with nothing to download. So we
build a small Llama-architecture model (~0.8M parameters), teach it the answer format with a
short supervised pass on solved *easy* problems (`cohort_grpo.sft.sft_trainer.tiny_warm_start`), and cache
the result as an ordinary Hugging Face folder (`AutoModelForCausalLM` / `AutoTokenizer` load it) in
the user cache folder. GRPO then trains it on harder problems than it was shown.

A second built-in model, the tiny *tools* model (`TINY_TOOLS_MODEL`, the calculator task's default), has
the characters JSON needs, Qwen's tool tags as single tokens and a Hermes-style chat template; its warm
start (`cohort_grpo.sft.sft_tools.tools_warm_start`) teaches it to call a calculator on some problems.
A model name of the form `cohort:<name>` (`BUILTIN_MODELS`) stands for one of these.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


ANSWER_TAGS = ["<answer>", "</answer>"]
CHARS = list("0123456789+-*=?<>/.,:()# ") + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") + ["\n"]

# Everything that changes the warm-started model goes into the cache key.
TINY_SPEC = {
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "sft_levels": [2, 3],
    "sft_steps": 2000,  # at most; the pass stops once validation accuracy reaches the target below
    "sft_target_accuracy": 0.5,
    "sft_min_steps": 300,
    "sft_batch_size": 64,
    "sft_learning_rate": 3e-3,
    "sft_seed": 0,
    "version": 3,
}


# ---- the tools variant: JSON characters, Qwen's tool tags as single tokens, a Hermes-style template
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOLS_CHARS = CHARS + list('"{}[]_\'!;&|%$@^~`\\')
TINY_TOOLS_MODEL = "cohort:tiny-tools"

# The Hermes layout without the tools list in a system turn (the tiny context is short, and the warm
# start teaches the one tool): a user turn is its content and a newline; an assistant turn its content,
# its calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, then EOS; a tool turn
# <tool_response>content</tool_response> and a newline. The assistant turn needs no opening text, so
# add_generation_prompt adds nothing and the model writes right after the prompt.
TINY_TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- eos_token }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<tool_response>' + message.content + '</tool_response>\\n' }}"
    "{%- else %}"
    "{{- message.content + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

TINY_TOOLS_SPEC = {
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "chat_template": TINY_TOOLS_TEMPLATE,
    "chars": "".join(TOOLS_CHARS),
    "sft_steps": 1500,  # at most; the first pass stops once call trajectories are reproduced (see sft_tools)
    "sft_min_steps": 100,
    "sft_target_exact": 0.95,
    "sft_tool_fraction": 0.3,  # of the second pass's problems solved with a call; the rest answered directly
    "sft_mix_steps": 150,
    "sft_batch_size": 32,
    "sft_learning_rate": 3e-3,
    "sft_seed": 0,
    "version": 1,  # bump when the warm start's code or the calculator task's problems change
}


def build_tools_tokenizer(spec: dict = TINY_TOOLS_SPEC):
    """The tools model's tokenizer: the characters of `spec["chars"]`, the answer and tool tags as single
    tokens, and the tools chat template."""
    tokenizer = build_tokenizer(list(spec["chars"]), ANSWER_TAGS + TOOL_TAGS)
    tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def cache_root() -> Path:
    base = os.environ.get("COHORT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cohort"
    )
    return Path(base)


def build_tokenizer(chars=CHARS, tags=ANSWER_TAGS):
    """A character-level tokenizer: one token per character of `chars`, plus <pad>, <eos>, <unk>, and
    each of `tags` as a single token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    # A BPE model with no merges splits text into single characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    # The answer tags are one token each: shorter sequences, and the format is one decision, not eight.
    backend.add_tokens(list(tags))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def build_model(tokenizer, seed: int = 0, spec: dict = TINY_SPEC):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


BUILTIN_MODELS = ("cohort:tiny-arithmetic", TINY_TOOLS_MODEL)  # built and warm-started by cohort_grpo.sft.builtin


def is_builtin_model(name) -> bool:
    return isinstance(name, str) and name in BUILTIN_MODELS


def run_device(spec: str, model) -> str:
    """The device option a run of `model` (None: the built-in default) uses: `auto` is the CPU for the built-in
    tiny models, since a few-layer model's step is kernel-launch bound on a GPU (docs/performance.md: the
    default job trains faster on four CPU cores than on an H200); any other model or spelling is kept."""
    if spec == "auto" and (model is None or is_builtin_model(model)):
        return "cpu"
    return spec
