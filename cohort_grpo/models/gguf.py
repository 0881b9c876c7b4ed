"""Read llama.cpp GGUF files (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) as HF weights.

Quantised tensors are dequantised to float32 with the `gguf` package; tensor names are mapped to
transformers' names; llama.cpp's convert script permutes the rows of Llama-family q/k projections
(to its interleaved RoPE layout), which we undo; the `ModelConfig` comes from the file's metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.models.config import ModelConfig

# GGUF architecture -> HF model_type. llama.cpp also writes Mistral checkpoints as "llama".
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q/k rows llama.cpp permuted (convert_hf_to_gguf.py, LlamaModel.permute).
PERMUTED_QK = {"llama", "mistral"}

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str) -> str | None:
    """transformers' name of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: per head, rows were reordered from the rotate-half layout
    (first half / second half) to interleaved pairs; put them back. Works for weights and biases."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value


def read_config(reader, has_output_weight: bool) -> ModelConfig:
    """A `ModelConfig` from GGUF metadata (`{arch}.block_count`, `{arch}.attention.head_count`, ...)."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CohortError(
            f"unsupported GGUF architecture {arch!r}: cohort reads {', '.join(ARCHITECTURES)} GGUF files"
        )

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    vocab = meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    hf = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length") or meta("rope.dimension_count") or hidden // heads,
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "tie_word_embeddings": not has_output_weight,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling_type = meta("rope.scaling.type")
    if scaling_type in ("linear", "yarn"):
        hf["rope_scaling"] = {"rope_type": scaling_type, "factor": meta("rope.scaling.factor")}
        if scaling_type == "yarn":
            hf["rope_scaling"]["original_max_position_embeddings"] = meta("rope.scaling.original_context_length")
    window = meta("attention.sliding_window")
    if window and hf["model_type"] == "mistral":
        hf["sliding_window"] = window
    return ModelConfig.from_hf_dict(hf)


def load_gguf(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, float32 state dict with transformers' names) of a GGUF file."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as error:  # bad magic / truncated file
        raise CohortError(f"cannot read GGUF file {path}: {error}; re-download it") from error
    names = {tensor.name for tensor in reader.tensors}
    config = read_config(reader, has_output_weight="output.weight" in names)
    permute = _field(reader, "general.architecture") in PERMUTED_QK
    state = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_freqs"):
                raise CohortError(f"GGUF file {path} uses per-frequency RoPE factors (Llama 3.1 style), which cohort "
                                  "does not read from GGUF; load the model's HF safetensors folder instead")
            raise CohortError(f"GGUF file {path} has tensor {tensor.name!r} that cohort cannot map to a model weight")
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy, not the memmap
        if permute and ".q_proj." in name:
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif permute and ".k_proj." in name:
            weight = unpermute_qk(weight, config.num_key_value_heads)
        state[name] = weight
    return config, state
