"""GGUF loading: tiny GGUF files written here from transformers models, and the real SmolLM2 file
against transformers' own GGUF loader."""

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from cohort_grpo.errors import CohortError
from cohort_grpo.models import from_pretrained, load_tokenizer

gguf = pytest.importorskip("gguf")
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, rope_theta=50000.0)
LAYER_NAMES = {  # transformers -> llama.cpp, written out here independently of cohort_grpo.models.gguf
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama q/k rows (rotate-half -> interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def write_gguf(model, arch: str, path: Path, quantise: str | None = None) -> Path:
    """A GGUF file of a transformers model, as llama.cpp would write it (F32, one tensor optionally Q8_0)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim(config))
    writer.add_eos_token_id(5)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if name == quantise:
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def tiny_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("arch, config", [
    ("llama", LlamaConfig(**TINY)),
    ("llama", LlamaConfig(**TINY, tie_word_embeddings=True)),
    ("qwen2", Qwen2Config(**TINY)),
    ("qwen3", Qwen3Config(**TINY, head_dim=32)),
])
def test_tiny_gguf_matches_the_transformers_model(tmp_path, arch, config):
    reference = tiny_model(config)
    ours = from_pretrained(write_gguf(reference, arch, tmp_path / "tiny.gguf"))
    assert ours.config.model_type == reference.config.model_type
    assert ours.config.tie_word_embeddings == reference.config.tie_word_embeddings
    assert (ours.config.head_dim, ours.config.rope_theta, ours.config.eos_token_id) == (head_dim(config), 50000.0, 5)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max() <= 1e-4


def test_quantised_tensor_is_dequantised(tmp_path):
    reference = tiny_model(LlamaConfig(**TINY))
    name = "model.layers.0.mlp.up_proj.weight"
    ours = from_pretrained(tmp_path, gguf_file=write_gguf(reference, "llama", tmp_path / "q.gguf", name).name)
    original, loaded = reference.state_dict()[name], ours.state_dict()[name]
    scale = original.reshape(-1, 32).abs().amax(-1, keepdim=True) / 127  # Q8_0: 32 weights, one scale
    assert ((loaded.reshape(-1, 32) - original.reshape(-1, 32)).abs() <= scale).all()  # one step (fp16 scale)
    assert not torch.equal(loaded, original)  # it really went through 8-bit


def test_bad_gguf_files(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CohortError, match="cannot read GGUF"):
        from_pretrained(tmp_path / "junk.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), arch="gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CohortError, match="'gpt2'"):
        from_pretrained(tmp_path / "gpt2.gguf")
    with pytest.raises(CohortError, match="several GGUF files"):
        from_pretrained(tmp_path)


# ---- the real SmolLM2-135M-Instruct Q4_1 file (conftest's smollm2_gguf fixture) ------------------
@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader(smollm2_gguf):
    smollm2_gguf = Path(smollm2_gguf)
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    reference = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()
    ours = from_pretrained(smollm2_gguf)
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                 "vocab_size", "tie_word_embeddings"):
        assert getattr(ours.config, name) == getattr(reference.config, name), name
    ids = torch.randint(0, ours.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - reference(ids).logits).abs().max() <= 1e-4


@pytest.mark.slow
def test_smollm2_gguf_tokenizer(smollm2_gguf):
    smollm2_gguf = Path(smollm2_gguf)
    tokenizer = load_tokenizer(smollm2_gguf)
    text = "What is 12 + 30?"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text
    assert len(tokenizer) == 49152
