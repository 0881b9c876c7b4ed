"""The generic path: transformers' own modules behind cohort's model interface (cohort_grpo/models/generic.py).

Each family is a tiny random model built here from transformers' own config class (float32, CPU, no network),
checked against transformers itself: the logits of its own forward, the tokens of its own greedy `generate`, its
teacher-forced log-probs of the engine's samples; then a two-step `cohort-grpo train` of its saved folder."""

import copy
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers

from cohort_grpo.errors import CohortError
from cohort_grpo.models.cache import KVCache
from cohort_grpo.models.generic import TransformersCausalLM
from cohort_grpo.models.generic_attention import STATE_INTERFACE_SINCE, GenericPathRefused, has_state_interface, refusal
from cohort_grpo.models.tiny import build_tokenizer
from cohort_grpo.rollout import engine_samples, make_sampler
from cohort_grpo.rollout.engine import Engine
from cohort_grpo.rollout.layout import PADDED, Layout
from cohort_grpo.rollout.sampler import SamplingParams
from cohort_grpo.run.policy import load_policy
from cohort_grpo.update.logprobs import rollout_logprobs, supports_hidden, takes_attention_rows

pytestmark = pytest.mark.cpu("float32 tolerances of CPU forwards")

VOCAB = len(build_tokenizer())  # the built-in character tokenizer's, so a saved folder trains with it
WINDOW = 4  # sliding windows, shorter than the prompts below
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=256, pad_token_id=0, bos_token_id=2, eos_token_id=1)
GQA = dict(SHAPE, num_key_value_heads=2)
SLIDING_GLOBAL = ["sliding_attention", "full_attention"] * 2

# model type: (config class, causal LM class, its config's arguments)
FAMILIES = {
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                    dict(GQA, head_dim=16, sliding_window=WINDOW, layer_types=SLIDING_GLOBAL,
                         final_logit_softcapping=30.0, query_pre_attn_scalar=16)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(GQA, sliding_window=WINDOW)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, GQA),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, GQA),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(GQA, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                dict(GQA, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                     attention_multiplier=0.2)),
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, dict(GQA, logit_scale=0.5)),
    "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM,
                 dict(GQA, partial_rotary_factor=0.25, use_qkv_bias=True)),
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                 dict(SHAPE, rotary_pct=0.25, use_parallel_residual=True)),
    "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM,
                   dict(GQA, sliding_window=WINDOW, use_bias=True)),
    # wider global heads, fewer of them with keys as values, and the last two layers reusing earlier keys
    "gemma4_text": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
                    dict(GQA, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                         sliding_window=WINDOW, layer_types=SLIDING_GLOBAL, num_kv_shared_layers=2,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)),
    "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM,
                dict(GQA, sliding_window=WINDOW, layer_types=SLIDING_GLOBAL)),
    # Gated DeltaNet layers keep a recurrent state per row (models/recurrent_state.py); weights large enough that
    # a state run through pad tokens, or not carried to a completion's row, changes the tokens
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                     dict(GQA, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
                          initializer_range=0.2)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(GQA, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, initializer_range=0.2)),
    # state-space hybrids (the same per-row states): Mamba 2 layers with attention between them, the scan's chunk
    # shorter than the prompts (its state carries from chunk to chunk), and mixture-of-experts MLPs (Granite 4.0)
    "granitemoehybrid": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                         dict(GQA, layer_types=["linear_attention", "full_attention"] * 2, mamba_n_heads=8,
                              mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=4, num_local_experts=4,
                              num_experts_per_tok=2, initializer_range=0.2)),
    # LFM2's gated short convolutions (a convolution state, no state matrix) around attention layers
    "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM,
             dict(GQA, layer_types=["conv", "full_attention"] * 2, block_auto_adjust_ff_dim=False,
                  initializer_range=0.2)),
    # Mamba 1 layers, whose scan over several tokens starts from a zero state (continued token by token)
    "jamba": (transformers.JambaConfig, transformers.JambaForCausalLM,
              dict(GQA, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, initializer_range=0.2)),
}
# model types whose layers keep a recurrent state, and the layer types that keep one
RECURRENT_FAMILIES = {"qwen3_5_text", "qwen3_next", "granitemoehybrid", "lfm2", "jamba"}
STATE_LAYER_TYPES = {"linear_attention", "conv"}
# No prompt token is the pad id 0 (generate would take it for padding); the longest exceed the window.
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [7, 3], [11, 4, 8, 15, 16, 23, 42, 6, 10, 12, 14, 19], [20, 21, 22],
           [30, 31, 32, 33, 34, 35]]


def reference_model(model_type: str, seed: int = 0):
    """transformers' own model of `model_type`, tiny and random, in eval mode, generating up to its limit."""
    config_class, model_class, arguments = FAMILIES[model_type]
    if model_type in RECURRENT_FAMILIES and not has_state_interface():
        pytest.skip(f"{model_type}'s recurrent layers need transformers' state interface ({STATE_INTERFACE_SINCE}+)")
    torch.manual_seed(seed)
    model = model_class(config_class(**arguments)).eval()
    model.generation_config.eos_token_id = None  # both samplers run to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def wrapped(reference):
    return TransformersCausalLM.wrap(copy.deepcopy(reference)).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    reference = reference_model(request.param)
    return request.param, reference, wrapped(reference)


def test_logits_equal_transformers_forward(family):
    """Full-sequence forwards, with and without padding, and a cached prefill equal transformers' logits."""
    _, reference, model = family
    torch.manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (3, 11))
    mask = torch.ones_like(input_ids)
    mask[1, 7:] = 0  # right padding, as cohort's rows are laid out
    cache = KVCache.for_model(model, 3, 16)
    with torch.no_grad():
        expected = reference(input_ids).logits
        assert (model(input_ids) - expected).abs().max() < 1e-4
        padded = reference(input_ids, attention_mask=mask).logits
        assert (model(input_ids, attention_mask=mask) - padded).abs()[mask.bool()].max() < 1e-4
        positions = torch.arange(11).expand(3, 11)
        assert (model(input_ids, positions, kv_cache=cache, cache_len=11) - expected).abs().max() < 1e-4


def test_engine_greedy_tokens_equal_generate(family):
    """Continuous batching (more prompts than rows) of prompts longer than the sliding window: the engine's
    greedy tokens are transformers' greedy `generate`'s, prompt by prompt."""
    _, reference, model = family
    new_tokens = 10
    rollout = Engine(model, max_batch_size=2, check_interval=3).generate(
        PROMPTS, 1, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, pad_token_id=0))
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False)[0, len(prompt):]
        assert rollout.completion_ids[row].tolist() == expected.tolist(), (row, prompt)


def test_sampling_logprobs_equal_teacher_forced(family):
    """The engine's log-probs of its sampled tokens (temperature 1) equal transformers' teacher-forced forward."""
    _, reference, model = family
    rollout = Engine(model, max_batch_size=3, check_interval=4).generate(
        PROMPTS[:3], 2, SamplingParams(max_new_tokens=8, temperature=1.0, pad_token_id=0, seed=3))
    worst = 0.0
    for row in range(rollout.completion_ids.shape[0]):
        prompt = PROMPTS[row // 2]
        completion = rollout.completion_ids[row]
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + completion.tolist()])).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1).gather(1, completion[:, None])[:, 0]
        worst = max(worst, float((logp - rollout.logprobs[row]).abs().max()))
    assert worst < 1e-4


def test_shared_prompt_layout_equals_padded_rows(family):
    """The update's shared-prompt forward (attention rows through cohort's attention) gives the log-probs of
    one padded row per completion (transformers' own attention); a head with soft-capping or a logit scale
    and a head that scales its logits (Granite, Cohere) or soft-caps them (this Gemma 3) gives through the chunked LM
    head the log-probs of transformers' own logits, at a sampling temperature too."""
    model_type, reference, model = family
    assert supports_hidden(model)
    assert takes_attention_rows(model) == (supports_hidden(model) and model_type not in RECURRENT_FAMILIES)
    if model_type in RECURRENT_FAMILIES:  # one flat row of several sequences would run through one state
        with pytest.raises(CohortError, match="layers that keep a recurrent state"):
            model(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), attention_rows=torch.tensor([[0, 1, 2]]),
                  attention_slots=torch.tensor([0, 1, 2]))
    if not takes_attention_rows(model):
        return
    torch.manual_seed(2)
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    completions = torch.randint(1, VOCAB, (4, 5))
    mask = torch.ones_like(completions)
    mask[1, 3:] = 0
    padded = rollout_logprobs(model, prompts, completions, mask, pad_id=0, max_rows=4, layout=PADDED)
    shared = rollout_logprobs(model, prompts, completions, mask, pad_id=0, max_rows=4,
                              layout=Layout(shared=True, group=2))
    assert (padded - shared).abs().max() < 1e-4
    temperature = 0.7
    warm = rollout_logprobs(model, prompts[:1], completions[:1], mask[:1], pad_id=0, max_rows=1, layout=PADDED,
                            temperature=temperature)
    with torch.no_grad():
        logits = reference(torch.tensor([prompts[0] + completions[0].tolist()])).logits[0]
    expected = torch.log_softmax(logits[len(prompts[0]) - 1: -1] / temperature, dim=-1).gather(1, completions[0][:, None])
    assert (warm[0] - expected[:, 0]).abs().max() < 1e-4


def test_qwen2_matches_the_native_implementation(tmp_path):
    """Qwen2 (sliding window on its upper layers) through the generic path and through cohort's own `CausalLM`:
    the same logits and the same greedy tokens."""
    from cohort_grpo.models.loading import from_pretrained

    reference = reference_model("qwen2")
    reference.save_pretrained(tmp_path)
    native, generic = from_pretrained(str(tmp_path)), wrapped(reference)
    input_ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        assert (native(input_ids) - generic(input_ids)).abs().max() < 1e-4
    params = SamplingParams(max_new_tokens=10, temperature=0.0, pad_token_id=0)
    tokens = [Engine(m, max_batch_size=2).generate(PROMPTS, 1, params).completion_ids for m in (native, generic)]
    assert torch.equal(*tokens)


def save_folder(model_type: str, path):
    reference_model(model_type).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", ["gemma3_text", "olmo2", "qwen3_5_text"])
def test_two_training_steps_from_the_command_line(model_type, tmp_path):
    """`cohort-grpo train --model_impl cohort` on a saved folder of a type cohort does not implement: it samples
    in the engine (the log line says the generic path) and trains two steps."""
    folder = save_folder(model_type, tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", "--model", folder, "--model_impl", "cohort",
                          "--max_steps", "2", "--output_dir", str(tmp_path / "run"), "--max_completion_length", "8",
                          "--num_generations", "2", "--per_device_train_batch_size", "4",
                          "--gradient_accumulation_steps", "1", "--device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{model_type} is not one of cohort's own implementations" in out.stdout + out.stderr
    assert (tmp_path / "run").is_dir()


def test_load_policy_wraps_other_types_and_keeps_native_and_hf(tmp_path):
    """auto: a type cohort does not implement gets the generic path (and the engine), one line saying so; hf keeps
    transformers' model; a native type stays native."""
    folder = save_folder("olmo2", tmp_path / "olmo2")
    lines = []
    model, _ = load_policy(folder, log=lines.append)
    assert isinstance(model, TransformersCausalLM) and engine_samples(model)
    assert isinstance(make_sampler(model), Engine) and len(lines) == 1 and "generic path" in lines[0]
    model, _ = load_policy(folder, impl="hf", log=lines.append)
    assert type(model).__name__ == "Olmo2ForCausalLM" and not engine_samples(model)


def test_recurrent_and_encoder_decoder_models_are_refused_by_name(tmp_path):
    """Layers whose state the engine cannot keep (outside transformers' cache interface), attention it cannot serve
    and encoder-decoders are refused by name: auto takes transformers' generate and says why; model_impl cohort is a
    one-line error. State-space hybrids that keep their state through the interface are not refused."""
    assert "encoder-decoder" in refusal(transformers.T5Config())
    assert "rwkv has recurrent layers the engine cannot keep" in refusal(transformers.RwkvConfig())
    assert "minimax has recurrent layers the engine cannot keep" in refusal(transformers.MiniMaxConfig())
    assert "zamba's attention block is shared by several layers" in refusal(transformers.ZambaConfig())
    for config in (transformers.MambaConfig(), transformers.FalconH1Config(), transformers.NemotronHConfig(),
                   transformers.Lfm2Config(layer_types=["conv", "full_attention"], num_hidden_layers=2)):
        assert refusal(config) is None if has_state_interface() else "upgrade transformers" in refusal(config)
    unknown_hybrid = SimpleNamespace(model_type="some_hybrid", layer_types=["full_attention", "mamba"])
    assert "some_hybrid has layers of type mamba" in refusal(unknown_hybrid)
    assert refusal(transformers.Gemma3TextConfig()) is None
    # Doge's mask holds learned values: wrapped, its logits differed from its own forward's (docs/models.md).
    assert "doge's attention mask carries learned values" in refusal(transformers.DogeConfig())
    model = transformers.RwkvForCausalLM(transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32,
                                                                 attention_hidden_size=32, intermediate_size=64,
                                                                 num_hidden_layers=2))
    with pytest.raises(GenericPathRefused, match="rwkv"):
        TransformersCausalLM.wrap(model)
    model.save_pretrained(tmp_path / "rwkv")
    build_tokenizer().save_pretrained(tmp_path / "rwkv")
    lines = []
    kept, _ = load_policy(str(tmp_path / "rwkv"), log=lines.append)
    assert isinstance(kept, transformers.RwkvForCausalLM) and "rwkv takes transformers' generate" in lines[0]
    with pytest.raises(CohortError, match="model_impl=cohort cannot serve this model: rwkv"):
        load_policy(str(tmp_path / "rwkv"), impl="cohort")


@pytest.mark.parametrize("model_type", sorted(RECURRENT_FAMILIES))
def test_linear_attention_prompts_prefill_unpadded(model_type):
    """A model whose layers keep a recurrent state (linear attention, state space, convolution) prefills prompts of
    one length per forward (a pad token after a shorter prompt would run into its state), and its rows' states are
    the engine's: a cached prefill then single-token steps over rows in another order give transformers' logits of
    each sequence."""
    model = wrapped(reference_model(model_type))
    engine = Engine(model, max_batch_size=4)
    engine.generate([[5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15], [16, 17]], 1,
                    SamplingParams(max_new_tokens=2, temperature=0.0, pad_token_id=0))
    assert engine.stats["prefill_forwards"] == 3 and engine.stats["prefill_tokens"] == 3 + 3 + 5 + 2
    cache = KVCache.for_model(model, num_rows=3, max_len=8)
    layer_types = model.config.layer_types
    assert {layer for layer, _, _ in cache.recurrent.tensors} == {
        index for index, kind in enumerate(layer_types) if kind in STATE_LAYER_TYPES}
    torch.manual_seed(4)
    tokens = torch.randint(1, VOCAB, (2, 8))
    with torch.no_grad():
        expected = model.transformers_model(tokens).logits
        model(tokens[:, :5], torch.arange(5).expand(2, 5), kv_cache=cache, cache_rows=torch.tensor([2, 0]))
        cache.move_rows(torch.tensor([2]), torch.tensor([1]))  # sequence 0 now in row 1, sequence 1 in row 0
        for position in range(5, 8):
            logits = model(tokens[[1, 0], position:position + 1], torch.full((2, 1), position), kv_cache=cache)
            assert (logits[:, 0] - expected[[1, 0], position]).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "jamba"])
def test_chat_decoding_of_a_linear_attention_model_through_a_rewind(model_type):
    """`cohort-grpo chat`'s cached decoding (several tokens, then one at a time, over a row's recurrent state) gives
    transformers' logits; a rewind, which cannot undo a recurrent state, runs the kept history again. Mamba 1's
    scan over several tokens ignores a carried state: the wrapper continues its rows token by token."""
    from cohort_grpo.cli.chat import CachedDecoder

    model = wrapped(reference_model(model_type))
    assert model.continues_by_token == (model_type == "jamba")
    torch.manual_seed(5)
    ids = torch.randint(1, VOCAB, (20,)).tolist()

    def logits_after(tokens):
        with torch.no_grad():
            return model.transformers_model(torch.tensor([tokens])).logits[0, -1]

    decoder = CachedDecoder(model)
    assert (decoder.extend(ids[:6]) - logits_after(ids[:6])).abs().max() < 1e-4
    for n in range(7, 10):
        assert (decoder.extend([ids[n - 1]]) - logits_after(ids[:n])).abs().max() < 1e-4
    decoder.rewind(4)
    assert (decoder.extend(ids[12:16]) - logits_after(ids[:4] + ids[12:16])).abs().max() < 1e-4
    assert (decoder.extend(ids[16:20]) - logits_after(ids[:4] + ids[12:20])).abs().max() < 1e-4


def test_frozen_copy_and_state_dict_keep_transformers_names(family):
    """The wrapper's parameters carry transformers' names (checkpoints and saved folders are transformers'), and a
    deep copy (π_ref) is a separate model that computes the same logits."""
    from cohort_grpo.models.policy import frozen_copy

    model_type, reference, model = family
    assert list(model.state_dict()) == list(reference.state_dict())
    ref = frozen_copy(model)
    input_ids = torch.randint(1, VOCAB, (1, 7))
    with torch.no_grad():
        if model_type == "jamba":  # its dt projection is `weight @ x`, which torch folds otherwise without grad
            assert (ref(input_ids) - model(input_ids)).abs().max() < 1e-4
        else:
            assert torch.equal(ref(input_ids), model(input_ids))
    assert ref.transformers_model.get_input_embeddings() is not model.transformers_model.get_input_embeddings()


def test_each_layer_caches_keys_of_its_own_shape():
    """Gemma 4's global layers have other head counts and widths than its local ones: the engine's cache gives each
    layer the shape its attention module computes (kv heads, head dim), and its size is theirs summed."""
    model = wrapped(reference_model("gemma4_text"))
    attention = [layer.self_attn for layer in model.transformers_model.model.layers]
    expected = [(module.config.get_text_config().per_layer_config[index].num_key_value_heads, module.head_dim)
                for index, module in enumerate(attention)]
    assert expected == [(2, 16), (1, 32), (2, 16), (1, 32)]
    cache = KVCache.for_model(model, num_rows=3, max_len=10)
    assert [tuple(keys.shape) for keys in cache.k_layers] == [(3, heads, 10, width) for heads, width in expected]
    assert [tuple(values.shape) for values in cache.v_layers] == [(3, heads, 10, width) for heads, width in expected]
    assert cache.nbytes() == 2 * sum(3 * heads * 10 * width for heads, width in expected) * 4


@pytest.mark.parametrize("model_type", ["qwen2", "exaone4"])
def test_decode_steps_through_the_flash_decoding_kernel(model_type, monkeypatch):
    """On CUDA a decode step's attention reads the cache through cohort's flash-decoding kernel (here Triton's
    interpreter on the CPU): the engine's greedy tokens stay transformers' own, sliding windows included, and every
    decode step of every layer went through the kernel."""
    pytest.importorskip("triton", reason="triton is not installed; the decode kernel cannot run")
    from triton_interpreter import kernel_module

    from cohort_grpo.models import generic_attention

    kernel = kernel_module("cohort_grpo.kernels.decode_attention", "_decode_split_kernel").decode_attention
    calls = []

    def counted(query, *args, **kwargs):
        calls.append(query.shape)
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(generic_attention, "decode_attention", counted)
    monkeypatch.setattr(generic_attention, "triton_allowed", lambda tensor: True)
    reference = reference_model(model_type)
    model, new_tokens = wrapped(reference), 6
    rollout = Engine(model, max_batch_size=2, check_interval=3).generate(
        PROMPTS[:3], 1, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, pad_token_id=0))
    for row, prompt in enumerate(PROMPTS[:3]):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False)[0, len(prompt):]
        assert rollout.completion_ids[row].tolist() == expected.tolist(), (row, prompt)
    layers = reference.config.num_hidden_layers
    assert calls and len(calls) % layers == 0 and all(shape[2] == 1 for shape in calls)
    assert len(calls) // layers >= new_tokens - 1  # at least one sequence's decode steps, each layer once


@pytest.mark.skipif(not has_state_interface(), reason=f"needs transformers {STATE_INTERFACE_SINCE}+'s state interface")
def test_state_space_layer_kinds_take_their_cache_entries():
    """Nemotron-H mixes Mamba 2, attention, MLP-only and mixture-of-experts layers; Falcon-H1 runs attention and
    Mamba 2 side by side in every layer. Each layer takes keys only where it attends and a state only where it
    keeps one, and a prompt prefilled then decoded over the cache gives transformers' logits."""
    heads = dict(GQA, head_dim=16, initializer_range=0.2)
    nemotron = transformers.NemotronHConfig(**heads, layers_block_type=["linear_attention", "moe",
                                                                            "full_attention", "mlp"],
                                            mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                                            chunk_size=4, n_routed_experts=4, moe_intermediate_size=32,
                                            moe_shared_expert_intermediate_size=32)
    falcon = transformers.FalconH1Config(**dict(heads, num_hidden_layers=2), mamba_d_ssm=128, mamba_n_heads=8,
                                         mamba_d_state=16, mamba_chunk_size=4)
    expected_layers = {"nemotron_h": ([(0, 0), (0, 0), (2, 16), (0, 0)], {0}), "falcon_h1": ([(2, 16)] * 2, {0, 1})}
    for config in (nemotron, falcon):
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config).eval()
        model = wrapped(reference)
        shapes, state_layers = expected_layers[config.model_type]
        assert list(model.kv_cache_layer_shapes) == shapes
        cache = KVCache.for_model(model, num_rows=2, max_len=12)
        assert {layer for layer, _, _ in cache.recurrent.tensors} == state_layers
        torch.manual_seed(6)
        tokens = torch.randint(1, VOCAB, (2, 12))
        with torch.no_grad():
            expected = reference(tokens).logits
            logits = [model(tokens[:, :9], torch.arange(9).expand(2, 9), kv_cache=cache)]
            logits += [model(tokens[:, p:p + 1], torch.full((2, 1), p), kv_cache=cache) for p in range(9, 12)]
        assert (torch.cat(logits, dim=1) - expected).abs().max() < 1e-4, config.model_type


def test_recurrent_layers_are_refused_where_transformers_has_no_state_interface(monkeypatch):
    """Before transformers 5.21 a recurrent layer keeps its state in its model's own fields, out of the engine's
    reach: such a model is refused before it wraps, in one line naming the version it needs."""
    import transformers

    from cohort_grpo.models import generic_attention

    config = FAMILIES["qwen3_next"][0](**FAMILIES["qwen3_next"][2])
    assert generic_attention.refusal(config) is None or not generic_attention.has_state_interface()
    monkeypatch.setattr(generic_attention, "has_state_interface", lambda: False)
    assert generic_attention.refusal(config) == (
        "qwen3_next's recurrent layers keep their state through transformers' cache interface of 5.21 and later "
        f"(installed: {transformers.__version__}): upgrade transformers")
    assert generic_attention.refusal(FAMILIES["olmo2"][0](**FAMILIES["olmo2"][2])) is None
