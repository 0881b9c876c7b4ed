"""cohort_grpo.models against transformers' own implementations, on tiny random-init models of each family."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from reference_models import save_perturbed_references
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from cohort_grpo.errors import CohortError
from cohort_grpo.models import CausalLM, KVCache, ModelConfig, from_pretrained, is_supported, load_tokenizer, save_pretrained

torch.set_num_threads(1)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY),
    "llama_tied_llama3_rope": lambda: LlamaConfig(**TINY, tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "llama_yarn_rope": lambda: LlamaConfig(**TINY, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}),
    "llama_linear_rope_mha": lambda: LlamaConfig(**{**TINY, "num_key_value_heads": 4},
                                                 rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2_bias_tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen2_sliding": lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3_head_dim_32": lambda: Qwen3Config(**TINY, head_dim=32),
    "mistral_sliding": lambda: MistralConfig(**TINY, sliding_window=5),
}
LENGTH = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, folder it was saved to), weights perturbed so biases/norms matter."""
    return save_perturbed_references(FAMILIES, tmp_path_factory)


def _padding_batch():
    """Token ids, a mask with left padding (row 0) and right padding (row 1), and HF-style positions."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, LENGTH), generator=generator)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 9:] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    ids, mask, positions = _padding_batch()
    with torch.no_grad():
        plain_error = (ours(ids) - reference(ids).logits).abs().max()
        expected = reference(ids, attention_mask=mask, position_ids=positions).logits
        padded = ours(ids, positions, mask)
    assert plain_error <= 1e-4
    real = mask.bool()
    assert (padded - expected)[real].abs().max() <= 1e-4
    assert torch.isfinite(padded).all()  # pad queries must not produce NaN


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prefill_and_decode_match_full_forward(checkpoints, family):
    ours = from_pretrained(checkpoints[family][1])
    ids, _, _ = _padding_batch()
    lengths = [7, 4]  # row 1 is right-padded in the prefill; decode overwrites its pad slots
    cache = KVCache.for_model(ours, num_rows=3, max_len=32)
    rows = torch.tensor([2, 0])
    prefill_mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        full = ours(ids)
        prefill = ours(ids[:, :7], attention_mask=prefill_mask, kv_cache=cache, cache_rows=rows)
        assert cache.k[:, 0, :, 4:7].abs().max() == 0  # pad tokens did not write
        assert cache.k[:, 1].abs().max() == 0  # an unused row stays untouched
        for b, n in enumerate(lengths):
            assert (prefill[b, :n] - full[b, :n]).abs().max() <= 1e-4
        steps = torch.tensor(lengths)
        for _ in range(LENGTH - max(lengths)):  # T=1 decode, both rows at their own positions
            token = ids[torch.arange(2), steps][:, None]
            logits = ours(token, steps[:, None], kv_cache=cache, cache_rows=rows, cache_len=16)
            assert (logits[:, 0] - full[torch.arange(2), steps]).abs().max() <= 1e-4
            steps = steps + 1


def test_cache_rows_are_independent(checkpoints):
    """Two rows holding different sequences do not see each other's keys."""
    ours = from_pretrained(checkpoints["llama"][1])
    ids, _, _ = _padding_batch()
    cache = KVCache.for_model(ours, num_rows=2, max_len=LENGTH)
    with torch.no_grad():
        ours(ids[1:, :6], kv_cache=cache, cache_rows=torch.tensor([1]))
        alone = ours(ids[:1], kv_cache=cache, cache_rows=torch.tensor([0]))
        assert (alone - ours(ids[:1])).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["qwen2_sliding", "qwen3_head_dim_32"])
def test_default_cache_rows_decode_matches_full_forward(checkpoints, family):
    """cache_rows=None (rows 0..B-1, how the engine decodes): the write scatters in place, the read
    is a view of the cache, and prefill + decode still give the full forward's logits."""
    ours = from_pretrained(checkpoints[family][1])
    ids, _, _ = _padding_batch()
    lengths = [7, 4]
    cache = KVCache.for_model(ours, num_rows=3, max_len=32)
    prefill_mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        full = ours(ids)
        prefill = ours(ids[:, :7], attention_mask=prefill_mask, kv_cache=cache)
        assert cache.k[:, 1, :, 4:7].abs().max() == 0  # pad tokens did not write
        assert cache.k[:, 2].abs().max() == 0 and cache.v[:, 2].abs().max() == 0  # rows >= B untouched
        for b, n in enumerate(lengths):
            assert (prefill[b, :n] - full[b, :n]).abs().max() <= 1e-4
        steps = torch.tensor(lengths)
        for _ in range(LENGTH - max(lengths)):
            token = ids[torch.arange(2), steps][:, None]
            logits = ours(token, steps[:, None], kv_cache=cache, cache_len=16)
            assert (logits[:, 0] - full[torch.arange(2), steps]).abs().max() <= 1e-4
            steps = steps + 1
    keys, _ = cache.keys_values(0, None, 2, 16)
    assert keys.data_ptr() == cache.k_layers[0].data_ptr()  # a view: decode copies no cache rows
    with pytest.raises(CohortError, match="cache_rows"):
        ours(ids[:, :1].repeat(2, 1), kv_cache=cache)  # 4 rows into a 3-row cache


def _reference_gqa(q, k, v, mask):
    """Textbook GQA: every query head gets its own copy of its kv head, then softmax(qk^T/sqrt(d))v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("native_gqa", [False, True])
def test_grouped_query_attention_matches_repeated_heads(monkeypatch, native_gqa):
    from cohort_grpo.models import decoder

    monkeypatch.setattr(decoder, "_native_gqa_is_fast", lambda q: native_gqa)  # CPU math runs enable_gqa too
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 5, 8, generator=generator)
    k, v = torch.randn(2, 2, 9, 8, generator=generator), torch.randn(2, 2, 9, 8, generator=generator)
    causal_q = q[:, :, :5]
    assert torch.allclose(decoder.grouped_query_attention(causal_q, k[:, :, :5], v[:, :, :5], None),
                          _reference_gqa(causal_q, k[:, :, :5], v[:, :, :5], None), atol=1e-5)
    per_query_mask = torch.rand(2, 1, 5, 9, generator=generator) < 0.7
    per_query_mask[..., 0] = True  # every query sees at least one key
    assert torch.allclose(decoder.grouped_query_attention(q, k, v, per_query_mask),
                          _reference_gqa(q, k, v, per_query_mask), atol=1e-5)
    decode_mask = torch.arange(9)[None, None, None] <= torch.tensor([3, 8])[:, None, None, None]  # [B, 1, 1, S]
    assert torch.allclose(decoder.grouped_query_attention(q[:, :, :1], k, v, decode_mask),
                          _reference_gqa(q[:, :, :1], k, v, decode_mask), atol=1e-5)


@pytest.mark.parametrize("family", ["llama_tied_llama3_rope", "qwen2_sliding", "qwen3_head_dim_32"])
def test_save_pretrained_loads_in_transformers(checkpoints, family, tmp_path):
    reference, folder = checkpoints[family]
    ours = from_pretrained(folder)
    ours.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, _, _ = _padding_batch()
    with torch.no_grad():
        assert (reloaded(ids).logits - ours(ids)).abs().max() <= 1e-4
    saved = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in saved) == (not ours.config.tie_word_embeddings)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(reference).__name__]


def test_parameter_names_equal_transformers(checkpoints):
    reference, folder = checkpoints["qwen3_head_dim_32"]
    assert set(from_pretrained(folder).state_dict()) == set(reference.state_dict())


def test_config_round_trip_and_rope_layouts(checkpoints):
    for _, folder in checkpoints.values():
        hf = json.loads((folder / "config.json").read_text())
        config = ModelConfig.from_hf_dict(hf)
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    legacy = {**json.loads((checkpoints["llama"][1] / "config.json").read_text()), "rope_theta": 5e5,
              "rope_scaling": {"type": "linear", "factor": 4.0}}
    legacy.pop("rope_parameters")
    config = ModelConfig.from_hf_dict(legacy)
    assert (config.rope_theta, config.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 4.0})
    assert is_supported({"model_type": "qwen3"}) and not is_supported({"model_type": "gpt2"})


def test_bfloat16_load_keeps_rope_frequencies_in_float32(checkpoints):
    model = from_pretrained(checkpoints["llama"][1], dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    fp32 = from_pretrained(checkpoints["llama"][1])
    assert torch.equal(model.model.rotary_emb.inv_freq, fp32.model.rotary_emb.inv_freq)


def test_gradient_checkpointing_gives_the_same_gradients(checkpoints):
    ids, mask, positions = _padding_batch()
    grads = []
    for checkpointing in (False, True):
        model = from_pretrained(checkpoints["qwen2_bias_tied"][1]).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, positions, mask).logsumexp(-1)[mask.bool()].sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.bias.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_return_hidden_gives_logits_through_lm_head(checkpoints):
    model = from_pretrained(checkpoints["qwen2_bias_tied"][1])
    ids, _, _ = _padding_batch()
    with torch.no_grad():
        hidden = model(ids, return_hidden=True)
        assert hidden.shape == (2, LENGTH, TINY["hidden_size"])
        assert torch.allclose(hidden @ model.lm_head.weight.T, model(ids), atol=1e-5)
    assert model.num_parameters() == sum(p.numel() for p in checkpoints["qwen2_bias_tied"][0].parameters())


def test_random_init_model_saves_and_loads(tmp_path):
    config = ModelConfig(model_type="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = CausalLM(config)
    save_pretrained(model, tmp_path)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path)(ids), model(ids))


# ---- errors ------------------------------------------------------------------------------------
def test_missing_path_and_non_model_folder(tmp_path):
    with pytest.raises(CohortError, match=f"model folder '{tmp_path}/absent/deeper/model' does not exist \\({tmp_path}/ has"):
        from_pretrained(tmp_path / "absent" / "deeper" / "model")
    with pytest.raises(CohortError, match="no model at"):
        from_pretrained("nope")
    with pytest.raises(CohortError, match="no config.json"):
        from_pretrained(tmp_path)


def test_unsupported_model_type_is_named(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CohortError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        from_pretrained(tmp_path)


def _copy_config(checkpoints, tmp_path, family="llama"):
    (tmp_path / "config.json").write_text((checkpoints[family][1] / "config.json").read_text())


def test_corrupt_safetensors(checkpoints, tmp_path):
    _copy_config(checkpoints, tmp_path)
    original = (checkpoints["llama"][1] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(original[: len(original) // 2])
    with pytest.raises(CohortError, match="corrupt"):
        from_pretrained(tmp_path)


def test_missing_tensor_is_named(checkpoints, tmp_path):
    _copy_config(checkpoints, tmp_path)
    state = load_file(checkpoints["llama"][1] / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CohortError, match="model.layers.1.mlp.up_proj.weight"):
        from_pretrained(tmp_path)


def test_pickle_weights_are_refused(checkpoints, tmp_path):
    _copy_config(checkpoints, tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CohortError, match="pickle"):
        from_pretrained(tmp_path)


def test_sharded_checkpoint_loads(checkpoints, tmp_path):
    _copy_config(checkpoints, tmp_path)
    state = load_file(checkpoints["llama"][1] / "model.safetensors")
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, tmp_path / file)
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids, _, _ = _padding_batch()
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path)(ids), from_pretrained(checkpoints["llama"][1])(ids))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CohortError, match="model-00002-of-00002"):
        from_pretrained(tmp_path)


def test_load_tokenizer_from_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path)("hello world there")["input_ids"] == [1, 2, 0]


def test_dataclass_attributes_are_hf_names(checkpoints):
    config = from_pretrained(checkpoints["qwen3_head_dim_32"][1]).config
    reference = checkpoints["qwen3_head_dim_32"][0].config
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "model_type", "eos_token_id", "tie_word_embeddings"):
        assert getattr(config, name) == getattr(reference, name), name
    assert dataclasses.is_dataclass(config)
