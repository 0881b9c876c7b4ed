"""rollout_numerics="exact": the engine's sampling log-probs equal the trainer's log π_old bit for bit.

The kernels (cohort_grpo/kernels/exact_*.py) run in Triton's interpreter on the CPU. The interpreter's
tl.dot cannot multiply bf16 storage, so there the kernels widen tiles to float32 first (exact for
bf16 products); the test of each kernel's reduction order is that a row's bits do not change with the
rows beside it or its place in the batch. End to end, a tiny bf16 model samples with the `Engine`
(continuous batching over fewer slots than sequences, shared prompts) and the trainer scores the
same tokens in several layouts; torch.equal must hold everywhere.
"""

import os

import pytest
import torch
import transformers

if torch.cuda.is_available():
    pytest.skip("runs the kernels in Triton's CPU interpreter; on a GPU, bench/sampler_mismatch.py --numerics "
                "exact measures this path", allow_module_level=True)
pytest.importorskip("triton", reason="exact numerics run Triton kernels")

from triton_interpreter import kernel_module  # noqa: E402

matmul_kernels = kernel_module("cohort_grpo.kernels.exact_matmul", "_matmul_kernel")
attention_kernels = kernel_module("cohort_grpo.kernels.exact_attention", "_attention_kernel")
norm_kernels = kernel_module("cohort_grpo.kernels.exact_rms_norm", "_rms_norm_kernel")
elementwise_kernels = kernel_module("cohort_grpo.kernels.exact_elementwise", "_rotate_kernel")
kernel_module("cohort_grpo.kernels.logprobs", "_stats_kernel")

from cohort_grpo import GRPOConfig  # noqa: E402
from cohort_grpo.errors import CohortError  # noqa: E402
from cohort_grpo.kernels.elementwise import rms_norm_plain, rotate_plain, swiglu_gate_plain  # noqa: E402
from cohort_grpo.models import CausalLM, ModelConfig  # noqa: E402
from cohort_grpo.models.exact_layers import use_exact_numerics  # noqa: E402
from cohort_grpo.rollout import Engine  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402
from cohort_grpo.rollout.sampling import Truncation  # noqa: E402
from cohort_grpo.update.fused_head import micro_batch_policy_loss  # noqa: E402
from cohort_grpo.update.logprobs import rollout_logprobs  # noqa: E402
from cohort_grpo.rollout.layout import Layout  # noqa: E402
from cohort_grpo.update.packing import pack  # noqa: E402

torch.set_num_threads(1)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "qwen3_sliding": lambda: transformers.Qwen3Config(**TINY, head_dim=32, use_sliding_window=True, sliding_window=6,
                                                      max_window_layers=1),
    # q/k/v with biases and an activation other than SiLU (the fused gate/up's other branch)
    "qwen2_gelu": lambda: transformers.Qwen2Config(**TINY, hidden_act="gelu_pytorch_tanh"),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
GENERATIONS = 2


def build(family: str, dtype=torch.bfloat16) -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf_dict(FAMILIES[family]().to_dict()))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))  # varied outputs, norm weights that matter
    return model.to(dtype)


def rows_bitwise_invariant(fn, x: torch.Tensor) -> bool:
    """Whether fn(x[a:b]) equals rows a..b of fn(x) bit for bit, for batches of 1, 3 and 17 rows at
    several offsets (a row alone, among a few, among many; first, middle, last)."""
    full = fn(x)
    return all(torch.equal(fn(x[start:start + n]), full[start:start + n])
               for n in (1, 3, 17) for start in (0, 5, x.shape[0] - n))


# ---- (a) the matmul --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_rows_are_batch_invariant_and_match_float64(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 100, generator=generator).to(dtype)  # K not a multiple of the tile: a masked tail
    weight, bias = torch.randn(80, 100, generator=generator).to(dtype), torch.randn(80, generator=generator).to(dtype)
    product = matmul_kernels.matmul(x, weight, bias)
    assert rows_bitwise_invariant(lambda rows: matmul_kernels.matmul(rows, weight, bias), x)
    # a column's bits do not depend on the others: fused q/k/v equal the separate products
    assert torch.equal(torch.cat([matmul_kernels.matmul(x, weight[:30], bias[:30]),
                                  matmul_kernels.matmul(x, weight[30:], bias[30:])], dim=1), product)
    expected = (x.double() @ weight.double().T + bias.double())
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20  # one rounding of the float32 sum
    assert ((product.double() - expected).abs() <= ulp * expected.abs() + 1e-4).all()


def test_matmul_split_by_chunk_equals_the_whole_product_bitwise():
    """K cut into chunks summed in order: one program per chunk plus the ordered sum of their float32 partials
    gives the bits of one program walking every chunk, for any rows."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(20, 150, generator=generator).to(torch.bfloat16)  # 150 = 64 + 64 + 22: a short last chunk
    weight, bias = torch.randn(40, 150, generator=generator).to(torch.bfloat16), torch.randn(40, generator=generator).to(torch.bfloat16)
    whole = matmul_kernels.matmul(x, weight, bias, split=False, chunk_k=64)
    assert torch.equal(matmul_kernels.matmul(x, weight, bias, split=True, chunk_k=64), whole)
    assert rows_bitwise_invariant(lambda rows: matmul_kernels.matmul(rows, weight, bias, split=True, chunk_k=64), x)
    assert matmul_kernels.plan(4, 40, 10**5, torch.device("cpu")) == matmul_kernels.Plan(matmul_kernels.TILE, False)


def test_a_tile_the_gpu_cannot_launch_gives_way_to_the_default_tile(monkeypatch):
    generator = torch.Generator().manual_seed(5)
    x, weight = torch.randn(8, 70, generator=generator), torch.randn(16, 70, generator=generator)
    big = matmul_kernels.Tile(128, 256, 64, 8, 3)
    launch = matmul_kernels.launch

    def no_room_for_big(x2, w, bias, out, tile, split, chunk_k):
        if tile == big:
            raise matmul_kernels.OUT_OF_RESOURCES(262144, 232448, "shared memory")
        launch(x2, w, bias, out, tile, split, chunk_k)

    monkeypatch.setattr(matmul_kernels, "launch", no_room_for_big)
    monkeypatch.setattr(matmul_kernels, "UNFIT_TILES", set())
    assert torch.equal(matmul_kernels.matmul(x, weight, tile=big), matmul_kernels.matmul(x, weight))
    assert matmul_kernels.UNFIT_TILES == {big}


def test_rotary_and_swiglu_kernels_compute_the_plain_functions():
    """float32 (whose products and sums the interpreter rounds as torch does): the rotary kernel is
    rotate_plain's function, written at cache positions as KVCache.write would; SiLU·mul within exp's rounding;
    both backwards are the plain functions' gradients."""
    generator = torch.Generator().manual_seed(4)
    batch, heads, length, dim = 2, 3, 20, 32
    fused = torch.randn(batch, length, heads * dim * 2, generator=generator)
    x = fused[..., :heads * dim].reshape(batch, length, heads, dim).transpose(1, 2)  # strided, as after a fused qkv
    cos, sin = (torch.randn(batch, length, dim, generator=generator) for _ in range(2))
    expected, _ = rotate_plain(x, x, cos, sin)
    assert torch.equal(elementwise_kernels.rotate(x, cos, sin), expected)
    cache = torch.zeros(3, heads, 48, dim)
    positions = torch.stack([torch.arange(length) + 3, torch.arange(length) + 11])
    elementwise_kernels.rotate_kernel(x, cos, sin, cache, positions)
    assert torch.equal(cache[0, :, 3:23], expected[0]) and torch.equal(cache[1, :, 11:31], expected[1])
    assert cache[2].abs().sum() == 0 and cache[0, :, :3].abs().sum() == 0
    elementwise_kernels.rotate_kernel(x, None, None, cache, positions)  # the values: copied, not rotated
    assert torch.equal(cache[1, :, 11:31], x[1])
    leaf = x.detach().requires_grad_()
    grad_out = torch.randn(x.shape, generator=generator)
    plain_grad = torch.autograd.grad(rotate_plain(leaf, leaf, cos, sin)[0], leaf, grad_out)[0]
    assert torch.allclose(torch.autograd.grad(elementwise_kernels.rotate(leaf, cos, sin), leaf, grad_out)[0],
                          plain_grad, atol=1e-6)
    gate, up = (torch.randn(37, 200, generator=generator).requires_grad_() for _ in range(2))
    out = elementwise_kernels.swiglu_gate(gate, up)
    assert torch.allclose(out, swiglu_gate_plain(gate, up), rtol=1e-6, atol=1e-6)
    grad_gated = torch.randn(37, 200, generator=generator)
    grads = torch.autograd.grad(out, (gate, up), grad_gated)
    plain = torch.autograd.grad(swiglu_gate_plain(gate, up), (gate, up), grad_gated)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, plain))


# ---- (b) attention and RMSNorm ---------------------------------------------------------------------
@pytest.mark.parametrize("window, dim", [(None, 32), (5, 24)])  # 24: the padded lanes of a head dim not a power of 2
def test_attention_decode_equals_the_full_forward_bitwise(window, dim):
    generator = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, length = 3, 4, 2, 70  # 70 keys: two key blocks of 64
    q, k, v = (torch.randn(batch, h, length, dim, generator=generator).to(torch.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    limits = torch.arange(length).expand(batch, length)
    full = attention_kernels.attention(q, k, v, limits, window, causal=True)
    reference = attention_kernels.attention_reference(q.double(), k.double(), v.double(), limits, window)
    assert (full.double() - reference).abs().max() < 2e-2  # bf16 outputs and bf16 probabilities in p·V
    for t in (0, 13, 63, 64, 69):
        # the one query of a decode step, against a cache whose slots after t hold anything
        cache_k, cache_v = k.clone(), v.clone()
        cache_k[:, :, t + 1:], cache_v[:, :, t + 1:] = 7.0, -3.0
        step = attention_kernels.attention(q[:, :, t:t + 1], cache_k, cache_v, torch.full((batch, 1), t), window)
        assert torch.equal(step, full[:, :, t:t + 1]), t


def test_rms_norm_rows_are_batch_invariant_and_match_the_plain_norm():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(30, 48, generator=generator).to(torch.bfloat16)
    weight = torch.randn(48, generator=generator).to(torch.bfloat16)
    assert rows_bitwise_invariant(lambda rows: norm_kernels.rms_norm(rows, weight, 1e-6), x)
    plain = rms_norm_plain(x, weight, 1e-6).float()
    # two bf16 roundings (the normalised value, then its product with the weight): within two ulps
    assert ((norm_kernels.rms_norm(x, weight, 1e-6).float() - plain).abs() <= 2 ** -6 * plain.abs() + 1e-6).all()


@pytest.mark.parametrize("family", ["llama", "qwen3_sliding", "qwen2_gelu"])
def test_fused_projections_give_the_separate_projections_bits(family, monkeypatch):
    """The engine fuses q/k/v and gate/up into one matrix each on CUDA (fusion.py), and π_old's no-grad forward
    then reads the fused matrices too: a fused branch wrong on both sides would pass the engine-against-trainer
    tests. Fused here explicitly, a no-grad forward that takes both fused products gives the bits of the same
    model's forward through the separate projections."""
    model = build(family)
    model.set_numerics("exact")
    ids = torch.tensor([PROMPTS[2], PROMPTS[0] + [21, 22, 23, 24, 25, 26]])
    model.fuse_projections()
    config = model.config
    qkv_rows = config.num_attention_heads * config.head_dim + 2 * config.num_key_value_heads * config.head_dim
    fused_products = {product for layer in model.model.layers for product in (
        (layer.self_attn.q_proj.weight.data_ptr(), qkv_rows),
        (layer.mlp.gate_proj.weight.data_ptr(), 2 * config.intermediate_size))}
    products, linear = set(), matmul_kernels.linear  # (where a weight starts, its rows) of each product
    monkeypatch.setattr(matmul_kernels, "linear", lambda x, weight, *rest: products.add(
        (weight.data_ptr(), weight.shape[0])) or linear(x, weight, *rest))
    with torch.no_grad():
        fused = model(ids)
    assert fused_products <= products  # every layer's two fused products ran
    for layer in model.model.layers:
        layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None
    products.clear()
    with torch.no_grad():
        separate = model(ids)
    assert not fused_products & products
    assert torch.equal(fused, separate)


# ---- (c) the engine against the trainer ------------------------------------------------------------
def sample(model: CausalLM, max_batch_size: int, **truncation):
    engine = Engine(model, max_batch_size=max_batch_size, check_interval=4)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, pad_token_id=0, eos_token_ids=[5], **truncation)
    return engine.generate(PROMPTS, GENERATIONS, params)


def test_engine_logprobs_equal_the_trainers_bitwise():
    """Qwen3's q/k norms, a sliding-window layer and a full one."""
    model = build("qwen3_sliding")
    model.set_numerics("exact")
    rollout = sample(model, max_batch_size=4)  # 6 sequences through 4 slots: continuous batching
    mask = rollout.completion_mask.bool()
    assert mask.sum() > 30
    rows = [p for p in PROMPTS for _ in range(GENERATIONS)]
    for shared, max_rows in ((True, 8), (False, 3), (True, 2)):  # each prompt once / padded rows; micro-batches
        old_logp = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0,
                                    max_rows=max_rows, temperature=0.8, layout=Layout(shared=shared))
        assert torch.equal(old_logp[mask], rollout.logprobs.float()[mask]), (shared, max_rows)


@pytest.mark.parametrize("cut", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2),
                                 dict(top_k=12, top_p=0.9, min_p=0.05)])
def test_under_truncation_the_engine_the_no_grad_pass_and_the_trained_forward_agree_bitwise(cut):
    """Top-k, top-p, min-p: the engine records the truncated distribution's log-prob (its kept set by
    `kept_logits` over the head's logits), π_old's pass and π_θ's fused head compute the same bits."""
    model = build("llama")
    model.set_numerics("exact")
    rollout = sample(model, max_batch_size=4, **cut)
    truncation = Truncation(**cut)
    mask = rollout.completion_mask.bool()
    rows = [p for p in PROMPTS for _ in range(GENERATIONS)]
    for shared, max_rows in ((True, 8), (False, 3)):
        old_logp = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0,
                                    max_rows=max_rows, temperature=0.8, layout=Layout(shared=shared),
                                    truncation=truncation)
        assert torch.equal(old_logp[mask], rollout.logprobs.float()[mask]), (shared, max_rows)
    full = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0, max_rows=8,
                            temperature=0.8, layout=Layout(shared=True))
    assert (old_logp[mask] - full[mask]).max() > 1e-3  # the kept mass: not the full softmax's log-prob
    model.train()
    micro = pack(rows, rollout.completion_ids, rollout.completion_mask, list(range(len(rows))), 0, Layout(shared=True))
    out = micro_batch_policy_loss(model, micro, old_logp=None, ref_logp=None,
                                  advantages=torch.linspace(-1, 1, len(rows)), loss_mask=micro.completion_mask,
                                  temperature=0.8, truncation=truncation)
    trained_mask = micro.completion_mask.bool()
    assert torch.equal(out.logp[trained_mask], rollout.logprobs.float()[micro.row_index][trained_mask])


def test_the_trained_forward_equals_pi_old_bitwise_and_its_gradient_is_the_fast_paths():
    """π_θ's forward with gradient (train mode, checkpointed layers, the fused head) is π_old's forward;
    its backward (torch's matmuls, SDPA by recomputation) gives the fast path's gradient (float32)."""
    rows = [p for p in PROMPTS for _ in range(GENERATIONS)]
    gradients = {}
    for numerics in ("exact", "fast"):
        model = build("llama", torch.float32)
        model.set_numerics(numerics)
        rollout = sample(model, max_batch_size=6) if numerics == "exact" else rollout
        old_logp = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0,
                                    max_rows=8, temperature=0.8, layout=Layout(shared=True))
        model.train()
        model.gradient_checkpointing_enable(checkpointed_layers=1)
        micro = pack(rows, rollout.completion_ids, rollout.completion_mask, list(range(len(rows))), 0,
                     Layout(shared=True))
        advantages = torch.linspace(-1, 1, len(rows))
        out = micro_batch_policy_loss(model, micro, old_logp=None, ref_logp=None, advantages=advantages,
                                      loss_mask=micro.completion_mask, temperature=0.8)
        out.loss.backward()
        gradients[numerics] = torch.cat([p.grad.flatten() for p in model.parameters()])
        if numerics == "exact":
            mask = micro.completion_mask.bool()
            assert torch.equal(out.logp[mask], old_logp[micro.row_index][mask])
            assert torch.equal(out.logp[mask], rollout.logprobs.float()[micro.row_index][mask])
    scale = gradients["fast"].abs().max()
    assert (gradients["exact"] - gradients["fast"]).abs().max() <= 1e-4 * scale


def test_exact_numerics_refuse_what_they_do_not_cover(monkeypatch):
    with pytest.raises(CohortError, match=r"rollout_numerics=exact does not cover LoRA"):
        GRPOConfig(rollout_numerics="exact", use_peft=True).validate()
    with pytest.raises(CohortError, match=r"rollout_numerics[= ]'?fast2"):
        GRPOConfig(rollout_numerics="fast2").validate()
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", "0")
    with pytest.raises(CohortError, match=r"not on cpu; use (--)?rollout_numerics[= ]'?fast"):
        use_exact_numerics(build("llama"), torch.device("cpu"))


def test_a_training_step_under_exact_numerics_reports_no_gap(tmp_path):
    """The run's option reaches the policy and the engine (π_ref's copy, which only the KL term reads, keeps the
    fast kernels); the step record says the gap is 0."""
    from cohort_grpo import GRPOTrainer
    from cohort_grpo.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, num_generations=2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=8, dtype="bfloat16", device="cpu",
                      rollout_numerics="exact", importance_sampling_correction=True, beta=0.04, quiet=True,
                      gradient_checkpointing=True, save_steps=0)
    rows = [{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 3)]
    trainer = GRPOTrainer(str(tmp_path / "tiny"), lambda completions, **_: [float(len(c) % 3) for c in completions],
                          rows, args=args, log=lambda *_: None)
    assert (trainer.model.numerics, trainer.ref_model.numerics, trainer.args.torch_compile) == ("exact", "fast", False)
    trainer.evaluate_held_out = lambda: None
    trainer.train()
    record = trainer.history[0]
    assert record["sampling/sampling_logp_difference/max"] == 0.0
    assert record["sampling/importance_sampling_ratio/min"] == record["sampling/importance_sampling_ratio/max"] == 1.0
