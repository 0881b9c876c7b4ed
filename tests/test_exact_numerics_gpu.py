"""rollout_numerics="exact" on a GPU (COHORT_TEST_GPU=1): the compiled Triton kernels, CUDA-graph decode and
the trainer's forward, bf16, bit for bit. On the CPU, tests/test_exact_numerics.py runs the same kernels in
Triton's interpreter; this file covers what only a GPU has (graph buckets, the real tile schedule)."""

import pytest
import torch
import torch.nn.functional as F
import transformers

if not torch.cuda.is_available():
    pytest.skip("needs a GPU: run with COHORT_TEST_GPU=1 on a machine with one", allow_module_level=True)
pytest.importorskip("triton", reason="exact numerics run Triton kernels")

from cohort_grpo.kernels.exact_matmul import matmul  # noqa: E402
from cohort_grpo.kernels.exact_rms_norm import rms_norm  # noqa: E402
from cohort_grpo.models import CausalLM, ModelConfig  # noqa: E402
from cohort_grpo.rollout import Engine  # noqa: E402
from cohort_grpo.rollout.layout import Layout  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402
from cohort_grpo.rollout.sampling import Truncation  # noqa: E402
from cohort_grpo.update.fused_head import micro_batch_policy_loss  # noqa: E402
from cohort_grpo.update.packing import pack  # noqa: E402
from cohort_grpo.update.logprobs import rollout_logprobs  # noqa: E402

CUDA = torch.device("cuda")
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=64),
    # an activation other than SiLU: the exact MLP's other branch
    "qwen2_gelu": lambda: transformers.Qwen2Config(**SHAPE, hidden_act="gelu_pytorch_tanh"),
}
# The activations by the names configs give them, written here rather than read from the model
ACTIVATION = {"silu": F.silu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}


def random_model(family: str) -> CausalLM:
    config = FAMILIES[family]()
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf_dict(config.to_dict()))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    model = model.to(CUDA, torch.bfloat16)
    model.set_numerics("exact")
    return model


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_gpu_matmul_and_norm_rows_do_not_depend_on_the_batch(rows):
    generator = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(512, 896, generator=generator, device=CUDA).bfloat16()
    weight = torch.randn(1152, 896, generator=generator, device=CUDA).bfloat16()
    norm_weight = torch.randn(896, generator=generator, device=CUDA).bfloat16()
    assert torch.equal(matmul(x[:rows], weight, None), matmul(x, weight, None)[:rows])
    assert torch.equal(rms_norm(x[:rows], norm_weight, 1e-6), rms_norm(x, norm_weight, 1e-6)[:rows])


@pytest.mark.parametrize("k", [896, 4864])
def test_gpu_every_tile_and_the_split_give_the_same_bits(k):
    """The tiles `plan` picks by the number of rows, and the split by chunk, are speed choices only."""
    from cohort_grpo.kernels import exact_matmul

    generator = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(600, k, generator=generator, device=CUDA).bfloat16()
    weight = (torch.randn(896, k, generator=generator, device=CUDA) / k ** 0.5).bfloat16()
    reference = matmul(x, weight, None, tile=exact_matmul.TILE, split=False)
    for _, tile in exact_matmul.TILES:
        for split in (False, True):
            assert torch.equal(matmul(x, weight, None, tile=tile, split=split), reference), (tile, split)
            assert torch.equal(matmul(x[:5], weight, None, tile=tile, split=split), reference[:5]), (tile, split)


def test_gpu_rotary_kernel_equals_torch_and_packed_decode_attention_equals_the_full_forward():
    from cohort_grpo.kernels import exact_attention, exact_elementwise
    from cohort_grpo.kernels.elementwise import rotate_plain

    generator = torch.Generator(device=CUDA).manual_seed(2)
    q = torch.randn(4, 14, 300, 64, generator=generator, device=CUDA).bfloat16()
    cos, sin = (torch.randn(4, 300, 64, generator=generator, device=CUDA).bfloat16() for _ in range(2))
    rotated = exact_elementwise.rotate(q, cos, sin).float()  # float32 arithmetic rounded once: within an ulp of it
    expected = rotate_plain(q.float(), q.float(), cos.float(), sin.float())[0]
    assert ((rotated - expected).abs() <= 2 ** -8 * expected.abs() + 1e-30).all()
    k, v = (torch.randn(4, 2, 300, 64, generator=generator, device=CUDA).bfloat16() for _ in range(2))
    limits = torch.arange(300, device=CUDA).expand(4, 300)
    full = exact_attention.attention_forward(q, k, v, limits)
    for t in (0, 63, 64, 200, 299):
        step = exact_attention.attention_forward(q[:, :, t:t + 1], k, v, limits[:, t:t + 1])
        assert torch.equal(step, full[:, :, t:t + 1]), t


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_engine_logprobs_equal_the_trainers_bitwise(family):
    """48 sequences through 16 slots (continuous batching, several graph buckets), shared prompts; the trainer
    scores them in three layouts."""
    model = random_model(family)
    prompts = [[1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(12)]
    generations = 4
    engine = Engine(model, max_batch_size=16)
    params = SamplingParams(max_new_tokens=48, temperature=0.9, seed=3, pad_token_id=0, eos_token_ids=[5])
    rollout = engine.generate(prompts, generations, params)
    mask = rollout.completion_mask.bool()
    assert mask.sum() > 1000
    rows = [p for p in prompts for _ in range(generations)]
    for shared, max_rows in ((True, 48), (False, 7), (True, 5)):
        old_logp = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0,
                                    max_rows=max_rows, temperature=0.9, layout=Layout(shared=shared))
        difference = (old_logp[mask] - rollout.logprobs.float()[mask]).abs().max().item()
        assert difference == 0.0, (family, shared, max_rows, difference)


@pytest.mark.parametrize("cut", [dict(top_k=20), dict(top_p=0.8), dict(min_p=0.1),
                                 dict(top_k=50, top_p=0.9, min_p=0.02)])
def test_gpu_engine_logprobs_equal_the_trainers_bitwise_under_truncation(cut):
    """Top-k, top-p, min-p through CUDA-graph decode: the engine records the truncated distribution's log-prob;
    π_old's pass (three layouts) and π_θ's fused head compute the same bits."""
    model = random_model("qwen3")
    prompts = [[1 + (7 * i + j) % 500 for j in range(5 + 3 * i)] for i in range(12)]
    generations = 4
    params = SamplingParams(max_new_tokens=48, temperature=0.9, seed=3, pad_token_id=0, eos_token_ids=[5], **cut)
    rollout = Engine(model, max_batch_size=16).generate(prompts, generations, params)
    mask = rollout.completion_mask.bool()
    assert mask.sum() > 1000
    rows = [p for p in prompts for _ in range(generations)]
    for shared, max_rows in ((True, 48), (False, 7), (True, 5)):
        old_logp = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0,
                                    max_rows=max_rows, temperature=0.9, layout=Layout(shared=shared),
                                    truncation=Truncation.of(params))
        difference = (old_logp[mask] - rollout.logprobs.float()[mask]).abs().max().item()
        assert difference == 0.0, (cut, shared, max_rows, difference)
    model.train()
    micro = pack(rows[:16], rollout.completion_ids[:16], rollout.completion_mask[:16], list(range(16)), 0,
                 Layout(shared=True)).to(CUDA)
    out = micro_batch_policy_loss(model, micro, old_logp=None, ref_logp=None, advantages=torch.linspace(-1, 1, 16,
                                  device=CUDA), loss_mask=micro.completion_mask, temperature=0.9,
                                  truncation=Truncation.of(params))
    trained = micro.completion_mask.bool()
    assert torch.equal(out.logp[trained].cpu(), rollout.logprobs.float()[micro.row_index.cpu()][trained.cpu()])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_engine_logprobs_equal_the_separate_projections_forward_bitwise(family):
    """The engine fuses q/k/v and gate/up on CUDA (fusion.py), and π_old's no-grad forward then reads the same
    fused matrices: the test above cannot see a fused branch wrong on both sides. Here the reference is the
    model's forward through its separate projections (the fused views dropped after sampling): the engine's
    log-probs of its tokens must be that forward's, bit for bit."""
    model = random_model(family)
    prompts = [[1 + (5 * i + j) % 500 for j in range(4 + 3 * i)] for i in range(8)]
    generations = 2
    params = SamplingParams(max_new_tokens=32, temperature=0.9, seed=5, pad_token_id=0, eos_token_ids=[5])
    rollout = Engine(model, max_batch_size=8).generate(prompts, generations, params)
    layers = model.model.layers
    assert all(layer.self_attn.fused_qkv is not None and layer.mlp.fused_gate_up is not None for layer in layers)
    for layer in layers:
        layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None
    mask = rollout.completion_mask.bool()
    assert mask.sum() > 200
    rows = [p for p in prompts for _ in range(generations)]
    for shared, max_rows in ((True, 16), (False, 5)):
        separate = rollout_logprobs(model, rows, rollout.completion_ids, rollout.completion_mask, pad_id=0,
                                    max_rows=max_rows, temperature=0.9, layout=Layout(shared=shared))
        difference = (separate[mask] - rollout.logprobs.float()[mask]).abs().max().item()
        assert difference == 0.0, (family, shared, max_rows, difference)


def float64_mlp(weights: dict[str, torch.Tensor], activation, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP in float64 from its three matrices, and a bound on how far a bf16 forward may be from it at
    worst: the products accumulated in float32 and each rounded to bf16 once (gate, up, down), the activation
    and the gating each rounded at most once more. A rounding moves a value by at most 2^-8 of itself; the
    gate's moves the activation by its slope times that; each error reaches the output through |down|."""
    x = x.double()
    gate = F.linear(x, weights["gate"].double()).requires_grad_()
    up = F.linear(x, weights["up"].double())
    active = activation(gate)
    slope, = torch.autograd.grad(active.sum(), gate)
    active, gate = active.detach(), gate.detach()
    hidden = active * up
    down = weights["down"].double()
    out = F.linear(hidden, down)
    # hidden: up's, the activation's and the product's roundings, and the gate's through the slope; the float32
    # sums (2^-24 a term, at most 2^9 terms here) are within the margin of 2^-7 over 3 · 2^-8
    hidden_error = 2 ** -7 * (active * up).abs() + 2 ** -8 * (slope * gate * up).abs()
    bound = F.linear(hidden_error, down.abs()) + 2 ** -7 * out.abs() + 1e-30
    return out, bound


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_gelu"])
def test_gpu_exact_fused_mlp_is_the_float64_mlp_within_bf16_rounding(family, monkeypatch):
    """The engine's no-grad MLP in exact numerics reads gate/up as one fused matrix (fusion.py). Against an MLP
    computed here in float64 from the separate gate, up and down matrices (not the model's code path), its
    output is within the bf16 roundings' worst-case bound for a decode row, a few rows and a prefill's many, and
    as near it as a few roundings are in the norm; with the fused halves read the other way round, it is not."""
    from cohort_grpo.kernels import exact_matmul

    model = random_model(family)
    model.fuse_projections()
    mlp = model.model.layers[1].mlp
    inner = model.config.intermediate_size
    weights = {"gate": mlp.gate_proj.weight.detach().clone(), "up": mlp.up_proj.weight.detach().clone(),
               "down": mlp.down_proj.weight.detach().clone()}
    activation = ACTIVATION[FAMILIES[family]().hidden_act]
    rows_of_products, linear = [], exact_matmul.linear
    monkeypatch.setattr(exact_matmul, "linear", lambda x, weight, *rest: rows_of_products.append(
        weight.shape[0]) or linear(x, weight, *rest))
    generator = torch.Generator(device=CUDA).manual_seed(6)
    for rows in (1, 7, 300):
        x = torch.randn(rows, SHAPE["hidden_size"], generator=generator, device=CUDA).bfloat16()
        rows_of_products.clear()
        with torch.no_grad():
            got = mlp(x).double()
        assert rows_of_products == [2 * inner, SHAPE["hidden_size"]]  # the fused gate/up product, then down
        expected, bound = float64_mlp(weights, activation, x)
        assert ((got - expected).abs() <= bound).all(), (family, rows, ((got - expected).abs() / bound).max())
        relative = float((got - expected).norm() / expected.norm())
        swapped, _ = float64_mlp({**weights, "gate": weights["up"], "up": weights["gate"]}, activation, x)
        swapped_relative = float((swapped - expected).norm() / expected.norm())
        # a few roundings' worth in the norm (about 3 · 2^-8 measured), the swapped halves' about 1
        assert relative <= 2 ** -5 and swapped_relative > 0.5, (family, rows, relative, swapped_relative)
