"""The sampling path's fused pieces (cohort_grpo/kernels/elementwise.py) against the unfused forward.

With fused kernels on and autograd off the model regroups its forward (residual add + RMSNorm,
q/k norm + rotary + KV-cache write, the additive attention mask built once per step). On plain ops
the regrouped forward must give exactly the unfused logits; compiled by torch.compile (inductor's
C++ backend here on CPU) within 1e-5. CPU, float32, tiny random models of each family.
"""

import collections
import functools
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cohort_grpo.rollout import Engine
from cohort_grpo.rollout import engine_setup
from cohort_grpo.models import KVCache
from cohort_grpo.kernels import elementwise as kernels
from cohort_grpo.models.causal_lm import _cache_mask
from cohort_grpo.models.decoder import RMSNorm
from cohort_grpo.rollout.sampler import SamplingParams
from helpers import KERNEL_FAMILIES as FAMILIES, KERNEL_TINY as TINY, build_kernel_model as build, decode_run

torch.set_num_threads(1)
# inductor's CPU backend compiles C++; without a compiler the compiled-vs-plain tests cannot run
needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                    reason="torch.compile on CPU needs a C++ compiler")


def assert_compiled(*names: str) -> None:
    """A compile failure falls back to plain ops with a notice; here it must not have happened."""
    assert not set(names) & kernels._failed, f"torch.compile failed for {set(names) & kernels._failed}"


@pytest.mark.parametrize("family", FAMILIES)
def test_regrouped_forward_on_plain_ops_equals_the_unfused_forward_exactly(family):
    model = build(family)
    ids = torch.randint(0, TINY["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        unfused = model(ids)
        with kernels.fused_kernels(True, compile=False):
            assert torch.equal(model(ids), unfused)
    reference, reference_cache = decode_run(model, ids, on=False)
    assert (reference - unfused[:, 5:]).abs().max() <= 1e-4  # the cached decode is itself right
    regrouped, cache = decode_run(model, ids, on=True, compile=False)
    assert torch.equal(regrouped, reference)
    assert torch.equal(cache.k, reference_cache.k) and torch.equal(cache.v, reference_cache.v)


@needs_compiler
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_compiled_decode_matches_the_unfused_forward(family):
    model = build(family)
    ids = torch.randint(0, TINY["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(2))
    reference, reference_cache = decode_run(model, ids, on=False)
    compiled, cache = decode_run(model, ids, on=True)
    assert_compiled("add_rms_norm", "rotate_and_cache", "cache_attention_bias")
    assert (compiled - reference).abs().max() <= 1e-5
    assert (cache.k - reference_cache.k).abs().max() <= 1e-5 and (cache.v - reference_cache.v).abs().max() <= 1e-5
    assert cache.k[:, -1].abs().max() == 0  # the row no sequence uses is never written


def test_training_forward_keeps_the_plain_math(monkeypatch):
    """With grad enabled the forward never reaches the regrouped pieces, even with fused kernels on."""
    model = build("qwen3_qk_norm").train()
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(4))
    expected = model(ids)

    def forbidden(*args):
        raise AssertionError("a fused piece was used in a training forward")

    for name in ("add_rms_norm", "rotate_and_cache", "cache_attention_bias"):
        monkeypatch.setattr(kernels, name, forbidden)
    with kernels.fused_kernels(True, compile=False):
        logits = model(ids)
        logits.logsumexp(-1).sum().backward()
    assert torch.equal(logits, expected)
    assert model.model.layers[0].self_attn.q_norm.weight.grad is not None


def test_add_rms_norm_is_the_residual_and_its_norm():
    generator = torch.Generator().manual_seed(5)
    x, delta, weight = torch.randn(3, 2, 16, generator=generator), torch.randn(3, 2, 16, generator=generator), \
        torch.randn(16, generator=generator)
    residual, normed = kernels.add_rms_norm_plain(x, delta, weight, 1e-6)
    assert torch.equal(residual, x + delta)
    by_formula = weight * residual / torch.sqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (normed - by_formula).abs().max() <= 1e-5


def test_rotate_and_cache_equals_norm_rotate_and_kv_cache_write():
    """The plain piece against the separate unfused ones: RMSNorm modules, rotate, KVCache.write."""
    generator = torch.Generator().manual_seed(6)
    batch, heads, kv_heads, dim = 3, 4, 2, 8
    q, k, v = (torch.randn(batch, 1, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    cos, sin = torch.randn(batch, 1, dim, generator=generator), torch.randn(batch, 1, dim, generator=generator)
    positions = torch.tensor([[4], [0], [9]])
    q_norm, k_norm = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6)
    with torch.no_grad():
        q_norm.weight.normal_(generator=generator)
        k_norm.weight.normal_(generator=generator)
    expected_cache = KVCache(1, batch + 1, kv_heads, 12, dim)
    expected_q, rotated_k = kernels.rotate_plain(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
    expected_cache.write(0, None, positions, rotated_k, v.transpose(1, 2))
    cache = KVCache(1, batch + 1, kv_heads, 12, dim)
    with torch.no_grad():
        got_q = kernels.rotate_and_cache_plain(q, k, v, cos, sin, q_norm.weight, k_norm.weight, 1e-6,
                                               cache.k_layers[0], cache.v_layers[0], positions)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(cache.k, expected_cache.k) and torch.equal(cache.v, expected_cache.v)
    assert torch.equal(cache.k_layers[0][1, :, 0], rotated_k[1, :, 0])  # row 1 at its position 0


@needs_compiler
@pytest.mark.slow
def test_compiled_pieces_equal_their_plain_versions():
    generator = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim, generator=generator)
    q, k, v = (part.reshape(batch, 1, -1, dim) for part in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    cos, sin = torch.randn(batch, 1, dim, generator=generator), torch.randn(batch, 1, dim, generator=generator)
    norms = torch.randn(dim, generator=generator), torch.randn(dim, generator=generator), 1e-6
    positions = torch.randint(0, 20, (batch, 1), generator=generator)
    x, delta, weight = torch.randn(batch, 1, 32, generator=generator), torch.randn(batch, 1, 32, generator=generator), \
        torch.randn(32, generator=generator)
    plain_caches = [torch.zeros(batch + 2, kv_heads, 24, dim) for _ in range(2)]
    compiled_caches = [torch.zeros(batch + 2, kv_heads, 24, dim) for _ in range(2)]
    with torch.inference_mode():
        plain_q = kernels.rotate_and_cache_plain(q, k, v, cos, sin, *norms, *plain_caches, positions)
        plain_sum, plain_norm = kernels.add_rms_norm_plain(x, delta, weight, 1e-6)
        plain_bias = kernels.cache_attention_bias_plain(positions, 24, 6, torch.float32)
        with kernels.fused_kernels(True):
            compiled_q = kernels.rotate_and_cache(q, k, v, cos, sin, *norms, *compiled_caches, positions)
            compiled_sum, compiled_norm = kernels.add_rms_norm(x, delta, weight, 1e-6)
            compiled_bias = kernels.cache_attention_bias(positions, 24, 6, torch.float32)
    assert_compiled("rotate_and_cache", "add_rms_norm", "cache_attention_bias")
    assert (compiled_q - plain_q).abs().max() <= 1e-6
    for plain, compiled in zip(plain_caches, compiled_caches):  # written in place, like the plain version
        assert (compiled - plain).abs().max() <= 1e-6 and compiled.abs().sum() > 0
    assert torch.equal(compiled_sum, plain_sum) and (compiled_norm - plain_norm).abs().max() <= 1e-6
    assert torch.equal(compiled_bias, plain_bias)


@pytest.mark.parametrize("window", [None, 3])
def test_additive_mask_gives_sdpa_the_boolean_masks_result(window):
    generator = torch.Generator().manual_seed(8)
    positions = torch.tensor([[0], [5], [11]])
    allowed = _cache_mask(positions, 12, window)
    bias = kernels.cache_attention_bias_plain(positions, 12, window, torch.float32)
    assert torch.equal(bias == 0, allowed) and torch.equal(bias[~allowed], torch.full_like(bias[~allowed], -65504.0))
    q, k, v = torch.randn(3, 2, 3, 8, generator=generator), torch.randn(3, 2, 12, 8, generator=generator), \
        torch.randn(3, 2, 12, 8, generator=generator)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


def test_compile_failure_falls_back_to_plain_ops(monkeypatch, capsys):
    class FakeCompilerError(Exception):
        pass

    FakeCompilerError.__module__ = "torch._inductor.exc"  # what fused() treats as a compiler failure

    def failing_compile(fn, **kwargs):
        def run(*args):
            raise FakeCompilerError("no backend")
        return run

    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_failed", set())
    monkeypatch.setattr(torch, "compile", failing_compile)
    model = build("qwen2_bias_tied")
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(9))
    expected, _ = decode_run(model, ids, on=False)
    got, _ = decode_run(model, ids, on=True)
    assert torch.equal(got, expected)
    assert {"add_rms_norm", "rotate_and_cache", "cache_attention_bias"} <= kernels._failed
    assert "torch.compile of rotate_and_cache failed (FakeCompilerError: no backend)" in capsys.readouterr().err


def test_engine_decodes_through_the_regrouped_path(monkeypatch):
    """The engine with fused kernels on (their plain versions, so no compile time on CPU) samples the
    same tokens and log-probs as with them off, and its decode step does take the fused path."""
    model = build("qwen3_qk_norm")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42]]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, eos_token_ids=[])
    expected = Engine(model, max_batch_size=4, compile_kernels=False).generate(prompts, 1, params)
    calls = []
    plain = kernels.rotate_and_cache_plain
    monkeypatch.setattr(kernels, "rotate_and_cache_plain", lambda *args: calls.append(1) or plain(*args))
    monkeypatch.setattr(engine_setup, "fused_kernels", functools.partial(kernels.fused_kernels, compile=False))
    got = Engine(model, max_batch_size=4, compile_kernels=True).generate(prompts, 1, params)
    assert len(calls) >= 9 * model.config.num_hidden_layers  # every decode step, every layer
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.logprobs, expected.logprobs)


class EagerOps(TorchDispatchMode):
    """Counts the aten ops that compute something (not views), except inside a fused piece."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.in_piece = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        allocation = func.__name__ in ("empty.memory_format", "lift_fresh.default")
        if not func.is_view and not self.in_piece and not allocation:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen2_bias_tied", "qwen3_qk_norm"])
def test_a_decode_layer_is_four_gemms_attention_and_four_fused_pieces(monkeypatch, family):
    """What one decoder layer adds to a decode step on the sampling path (the difference between a
    2-layer and a 1-layer model): the q/k/v, o, gate/up and down GEMMs, SDPA with the prebuilt
    additive mask, and the fused pieces; no eager elementwise op (each would be a kernel launch)."""
    counter = EagerOps()
    pieces = collections.Counter()
    real_fused = kernels.fused

    def recording(name, plain):
        def run(*args):
            pieces[name] += 1
            counter.in_piece = True
            try:
                return real_fused(name, plain)(*args)
            finally:
                counter.in_piece = False
        return run

    monkeypatch.setattr(kernels, "fused", recording)
    per_model = []
    for layers in (1, 2):
        model = build(family, layers)
        cache = KVCache.for_model(model, num_rows=4, max_len=16)
        pieces.clear()
        counter.ops.clear()
        with torch.inference_mode(), kernels.fused_kernels(True, compile=False), counter:
            model(torch.tensor([[1], [2], [3]]), torch.tensor([[4], [0], [7]]), kv_cache=cache, cache_len=16)
        per_model.append(counter.ops + pieces)
    assert per_model[1] - per_model[0] == {"linear.default": 4, "scaled_dot_product_attention.default": 1,
                                           "add_rms_norm": 2, "rotate_and_cache": 1, "swiglu_gate": 1}
