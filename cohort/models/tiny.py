"""The built-in default model: a tiny Llama with a character-level tokenizer.

`cohort train` with no arguments must run anywhere in minutes, with nothing to download. So we
build a small Llama-architecture model (~0.8M parameters), teach it the answer format with a
short supervised pass on solved *easy* problems (`cohort.algorithm.sft.tiny_warm_start`), and cache
the result as an ordinary Hugging Face folder (`AutoModelForCausalLM` / `AutoTokenizer` load it) in
the user cache folder. GRPO then trains it on harder problems than it was shown.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
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


def cache_root() -> Path:
    base = os.environ.get("COHORT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cohort"
    )
    return Path(base)


def build_tokenizer():
    """A character-level tokenizer: one token per character, plus <pad>, <eos>, <unk>."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    # A BPE model with no merges splits text into single characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    # The answer tags are one token each: shorter sequences, and the format is one decision, not eight.
    backend.add_tokens(ANSWER_TAGS)
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


def tiny_model_dir(log=print, spec: dict = TINY_SPEC) -> Path:
    """Path of the warm-started tiny model, building and caching it on first use."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root() / f"tiny-arithmetic-{key}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    log(f"Building the built-in tiny model (one-time SFT warm start, cached in {target}) ...")
    from ..algorithm.sft import tiny_warm_start  # training code: imported only when the cache is empty

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=spec["sft_seed"], spec=spec)
    tiny_warm_start(model, tokenizer, spec, log=log)
    # Write to a temporary folder and rename: a killed build never leaves a half-written cache.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target
