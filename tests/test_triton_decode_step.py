"""The decode step with the Triton kernels wired in (decode attention in `Attention.forward`, the
one-pass sampler in `sample_from_logits`) against the same step without them.

On a GPU the engine takes these kernels whenever fused kernels are on (`kernels.triton_kernel_on`).
Here, without CUDA, the kernels run in Triton's interpreter and `triton_kernel_on` is patched to
ignore the device, so the model's own routing (which layers call the kernel, with which window,
without the additive mask) is what is tested: logits within 1e-4 of the regrouped plain forward for
every family, sliding windows included, and the same sampled tokens.
"""

import pytest
import torch
import transformers

if torch.cuda.is_available():  # the CPU helpers (tests/helpers.py) build CPU tensors; the GPU has its own check
    pytest.skip("runs the kernels in Triton's CPU interpreter; on a GPU, `python bench/rollout.py --check` "
                "covers this path", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed: the engine's Triton kernels need it")

from helpers import KERNEL_FAMILIES as FAMILIES, KERNEL_TINY as TINY, build_kernel_model as build, decode_run  # noqa: E402

from triton_interpreter import kernel_module  # noqa: E402

from cohort_grpo.rollout import sampling# noqa: E402
from cohort_grpo.models import CausalLM, KVCache, ModelConfig, decoder
from cohort_grpo.kernels import elementwise as kernels# noqa: E402

torch.set_num_threads(1)  # as tests/test_kernels.py, whose models these are

decode_module = kernel_module("cohort_grpo.kernels.decode_attention", "_decode_split_kernel")
triton_sampling = kernel_module("cohort_grpo.kernels.sampling", "_partial_kernel")


def on_any_device(tensor: torch.Tensor) -> bool:
    """`kernels.triton_kernel_on` without its CUDA and torch.compile conditions."""
    return kernels.fused_path()


@pytest.fixture
def triton_path(monkeypatch):
    """Route the decode step through the (interpreted) Triton kernels. Returns the windows the
    attention kernel was called with (one entry per call) and the sampler's call count."""
    calls = dict(attention=[], sampling=0)

    def counted_decode_attention(*args, **kwargs):
        calls["attention"].append(kwargs.get("window", args[5] if len(args) > 5 else None))
        return decode_module.decode_attention(*args, **kwargs)

    def counted_gumbel_sample(*args, **kwargs):
        calls["sampling"] += 1
        return triton_sampling.gumbel_sample(*args, **kwargs)

    monkeypatch.setattr(kernels, "triton_kernel_on", on_any_device)
    monkeypatch.setattr(decoder, "decode_attention", counted_decode_attention)
    monkeypatch.setattr(sampling, "triton_kernel_on", on_any_device)
    monkeypatch.setattr(sampling, "gumbel_sample", counted_gumbel_sample)
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_with_triton_attention_equals_the_plain_regrouped_forward(family, triton_path):
    model = build(family)
    ids = torch.randint(0, TINY["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(2))
    reference, reference_cache = decode_run(model, ids, on=False)
    kernel_logits, cache = decode_run(model, ids, on=True, compile=False)
    steps, layers = ids.shape[1] - 5, model.config.num_hidden_layers
    windows = triton_path["attention"]
    assert len(windows) == steps * layers  # every layer of every decode step used the kernel
    assert sorted(windows, key=str) == sorted([model.config.layer_sliding_window(i) for i in range(layers)] * steps,
                                              key=str)
    assert (kernel_logits - reference).abs().max() <= 1e-4
    # layer 0 writes the same keys; later layers' keys inherit the attention's float rounding
    assert (cache.k - reference_cache.k).abs().max() <= 1e-5 and (cache.v - reference_cache.v).abs().max() <= 1e-5


def test_prefill_and_training_forwards_never_take_the_decode_kernel(triton_path):
    model = build("llama")
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), kernels.fused_kernels(True, compile=False):
        model(ids)  # full-sequence forward
        model(ids, kv_cache=KVCache.for_model(model, 2, 16), cache_rows=torch.arange(2))  # prefill
    with kernels.fused_kernels(True, compile=False):
        model(ids).sum().backward()  # autograd on: the plain math
    assert triton_path == dict(attention=[], sampling=0)


def test_sampling_through_the_triton_pass_draws_the_same_tokens(triton_path):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4)) * 3
    keys = dict(seed=torch.tensor(11), draw=torch.tensor([0, 1, 2, 3, 4]), rows=torch.arange(5) + 1000)
    with torch.inference_mode(), kernels.fused_kernels(True, compile=False):
        tokens, logprobs = sampling.sample_from_logits(logits, 0.8, **keys)
        assert triton_path["sampling"] == 1
        filtered_tokens, _ = sampling.sample_from_logits(logits, 0.8, top_k=3, **keys)  # filters: not this path
        assert triton_path["sampling"] == 1
    expected_tokens, expected_logprobs = sampling.sample_from_logits(logits, 0.8, **keys)  # fused kernels off
    assert triton_path["sampling"] == 1
    assert torch.equal(tokens, expected_tokens)
    assert (logprobs - expected_logprobs).abs().max() <= 1e-5
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(t) in row.tolist() for t, row in zip(filtered_tokens, top3))


def test_a_head_size_the_kernel_lacks_takes_sdpa(triton_path):
    """head_dim 24 is not one the kernel compiles (powers of two from 16): the step keeps SDPA."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dict(TINY, hidden_size=96, num_attention_heads=4))
    model = CausalLM(ModelConfig.from_hf_dict(config.to_dict())).eval()
    assert model.config.head_dim == 24
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(5))
    reference, _ = decode_run(model, ids, on=False)
    fused, _ = decode_run(model, ids, on=True, compile=False)
    assert triton_path["attention"] == []
    assert (fused - reference).abs().max() <= 1e-5


def test_engine_with_shared_prompts_samples_through_the_kernel_as_each_row_alone(triton_path, monkeypatch):
    """The engine's prefix table (rows of a prompt read its keys from the first row's cache) through
    the interpreted kernel: the same tokens as one-slot engines, where nothing is shared. Prompts of
    two lengths in one prefill chunk: the shorter one's table entry must stop at its own length."""
    import contextlib

    from cohort_grpo.rollout import engine as engine_module
    from cohort_grpo.rollout import Engine
    from cohort_grpo.rollout.sampler import SamplingParams

    @contextlib.contextmanager
    def plain_sampling_mode(model, fused=False):  # the fused pieces uncompiled: no torch.compile on CPU
        with torch.inference_mode(), kernels.fused_kernels(fused, compile=False):
            yield

    monkeypatch.setattr(engine_module, "sampling_mode", plain_sampling_mode)
    model = build("qwen2_bias_tied")
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    shared_engine = Engine(model, max_batch_size=8, use_cuda_graph=False, compile_kernels=True)
    shared = shared_engine.generate(prompts, 3, params)
    assert sorted(shared_engine.cache.prefix_lens.tolist())[-4:] == [3, 3, 7, 7]
    assert len(triton_path["attention"]) > 0
    alone = Engine(model, max_batch_size=1, use_cuda_graph=False, compile_kernels=True).generate(prompts, 3, params)
    assert torch.equal(shared.completion_ids, alone.completion_ids)
    assert torch.allclose(shared.logprobs, alone.logprobs, atol=1e-4)
