"""The generic path's fused sampling forwards (cohort_grpo/models/generic_fusion.py): RMSNorm and act(gate)·up as one
Triton kernel each (here in Triton's CPU interpreter), gate/up and q/k/v as one GEMM each.

Each family is a tiny random float32 transformers model (test_generic_models.py's, and Llama); the fused forwards
are held to the same model's own modules and to transformers' forward and `generate`."""

import copy
import sys

import pytest
import torch
import transformers

pytest.importorskip("triton", reason="the fused forwards run Triton kernels (interpreted on the CPU)")

from test_generic_models import GQA, PROMPTS, VOCAB, reference_model  # noqa: E402
from triton_interpreter import ON_CUDA, kernel_module  # noqa: E402

from cohort_grpo.kernels.elementwise import fused_kernels  # noqa: E402
from cohort_grpo.models import generic_fusion, generic_rotary  # noqa: E402
from cohort_grpo.models.cache import KVCache  # noqa: E402
from cohort_grpo.models.generic import TransformersCausalLM  # noqa: E402
from cohort_grpo.models.generic_fusion import FusedNorm, NormVariant, ProjectionGroup  # noqa: E402
from cohort_grpo.rollout import engine_setup  # noqa: E402
from cohort_grpo.rollout.engine import Engine  # noqa: E402
from cohort_grpo.rollout.sampler import SamplingParams  # noqa: E402

pytestmark = pytest.mark.cpu("Triton's interpreter and float32 tolerances of CPU forwards")

norm_kernels = kernel_module("cohort_grpo.kernels.exact_rms_norm", "_rms_norm_kernel")
gate_kernels = kernel_module("cohort_grpo.kernels.exact_elementwise", "_gated_activation_kernel")

MODEL_TYPES = ["gemma3_text", "llama", "olmo2", "phi3", "qwen2", "smollm3"]
LLAMA_NORM, OLMO_NORM, GEMMA_NORM = NormVariant(False, True), NormVariant(False, False), NormVariant(True, False)
EXPECTED_NORMS = {"gemma3_text": GEMMA_NORM, "olmo2": OLMO_NORM}  # the others round as Llama's


@pytest.fixture
def kernels(monkeypatch):
    """The kernels run here (the interpreter stands in for CUDA), each call counted: norms, gated activations, and
    the projection groups' fused GEMMs, rotaries (one call for q, one for k)."""
    if ON_CUDA:
        pytest.skip("runs the kernels on CPU tensors in Triton's interpreter; on a GPU, the kernels' own test below")
    counts = dict(norm=0, gate=0, gemm=0, rotate=0)
    norm, gate, outputs = norm_kernels.rms_norm_kernel, gate_kernels.gated_activation_kernel, ProjectionGroup.outputs
    rotate = gate_kernels.rotate_kernel

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    def counted_outputs(group, x):
        counts["gemm"] += group.current()
        return outputs(group, x)

    monkeypatch.setattr(generic_fusion, "triton_allowed", lambda tensor: True)
    monkeypatch.setattr(generic_rotary, "triton_allowed", lambda tensor: True)
    monkeypatch.setattr(norm_kernels, "rms_norm_kernel", counted("norm", norm))
    monkeypatch.setattr(gate_kernels, "gated_activation_kernel", counted("gate", gate))
    monkeypatch.setattr(gate_kernels, "rotate_kernel", counted("rotate", rotate))
    monkeypatch.setattr(ProjectionGroup, "outputs", counted_outputs)
    # the engine's sampling switch, its compiled pieces (the sampler's) left plain on the CPU
    monkeypatch.setattr(engine_setup, "fused_kernels", lambda on: fused_kernels(on, compile=False))
    return counts


def build(model_type: str, seed: int = 0):
    if model_type == "llama":
        torch.manual_seed(seed)
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GQA)).eval()
        reference.generation_config.eos_token_id = None
        reference.generation_config.pad_token_id = 0
    else:
        reference = reference_model(model_type, seed)
    with torch.no_grad():  # norm weights away from their initial ones and zeros, so that a wrong scale shows
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return reference, TransformersCausalLM.wrap(copy.deepcopy(reference)).eval()


def cached_logits(model, tokens: torch.Tensor, fused: bool) -> torch.Tensor:
    """A prefill of 6 tokens then single-token decode steps over a KV cache, on the sampling path (`fused`) or not."""
    cache = KVCache.for_model(model, tokens.shape[0], tokens.shape[1])
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
    with torch.inference_mode(), fused_kernels(fused, compile=False):
        logits = [model(tokens[:, :6], positions[:, :6], kv_cache=cache)]
        logits += [model(tokens[:, t:t + 1], positions[:, t:t + 1], kv_cache=cache) for t in range(6, tokens.shape[1])]
    return torch.cat(logits, dim=1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_eligible_modules_are_replaced_and_checked(model_type, kernels):
    """Every RMSNorm, gated MLP and q/k/v attention of the decoder is replaced (Phi-3's q/k/v are one projection
    already), each norm by the variant that computes it; names, parameters and state dict stay transformers'."""
    reference, model = build(model_type)
    decoder = reference.model
    norms = [m for m in decoder.modules() if type(m).__name__.endswith("RMSNorm")]
    layers = reference.config.num_hidden_layers
    fusions = model.fusions
    assert (fusions.norms, fusions.mlps, fusions.attentions) == (len(norms), layers,
                                                                  0 if model_type == "phi3" else layers)
    variants = {m.forward.variant for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedNorm)}
    assert variants == {EXPECTED_NORMS.get(model_type, LLAMA_NORM)}
    assert list(model.state_dict()) == list(reference.state_dict())
    assert kernels["norm"] > 0 and kernels["gate"] > 0  # the wrap-time checks ran the kernels


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_decoding_equals_the_modules_own(model_type, kernels):
    """A cached prefill and decode steps on the sampling path give the logits of the same model with the fusions
    off and of transformers' forward; each forward ran every norm and MLP through the kernels and every group's
    one GEMM. Off the sampling path (no fused switch) nothing is replaced."""
    reference, model = build(model_type)
    model.fuse_projections()
    torch.manual_seed(1)
    tokens = torch.randint(1, VOCAB, (3, 9))
    before = dict(kernels)
    fused = cached_logits(model, tokens, fused=True)
    forwards = 1 + tokens.shape[1] - 6
    fusions = model.fusions
    assert kernels["norm"] - before["norm"] == forwards * fusions.norms
    assert kernels["gate"] - before["gate"] == forwards * fusions.mlps
    assert kernels["gemm"] - before["gemm"] == forwards * len(fusions.groups)
    assert fusions.rotaries == 1
    rotary_layers = sum(getattr(reference.config, "no_rope_layers", [1] * reference.config.num_hidden_layers))
    assert kernels["rotate"] - before["rotate"] == forwards * 2 * rotary_layers
    during = dict(kernels)
    plain = cached_logits(model, tokens, fused=False)
    assert kernels == during
    fusions.on = False
    off = cached_logits(model, tokens, fused=True)
    assert kernels == during
    assert relative(fused, off) < 1e-5 and torch.equal(plain, off)
    with torch.no_grad():
        assert (fused - reference(tokens).logits).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_engine_greedy_tokens_unchanged(model_type, kernels):
    """The engine's greedy tokens on its fused sampling path are transformers' greedy `generate`'s."""
    reference, model = build(model_type)
    model.fuse_projections()  # what the engine does on CUDA before it decodes
    new_tokens = 8
    rollout = Engine(model, max_batch_size=2, check_interval=3, compile_kernels=True).generate(
        PROMPTS, 1, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, pad_token_id=0))
    assert kernels["gemm"] > 0 and kernels["norm"] > 0
    for row, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False)[0, len(prompt):]
        assert rollout.completion_ids[row].tolist() == expected.tolist(), (row, prompt)


def test_a_wrong_variant_is_refused(kernels, monkeypatch):
    """Gemma's norm scales by 1 + weight: offered only the plain variants, the check leaves every one of its norms
    alone (and its logits as they were); an MLP that gates up instead of gate, or whose activation is ReLU, keeps its
    own forward."""
    monkeypatch.setattr(generic_fusion, "NORM_VARIANTS", (LLAMA_NORM, OLMO_NORM))
    reference, model = build("gemma3_text")
    assert model.fusions.norms == 0 and model.fusions.mlps == 4
    torch.manual_seed(2)
    tokens = torch.randint(1, VOCAB, (2, 8))
    with torch.no_grad():
        assert (cached_logits(model, tokens, fused=True) - reference(tokens).logits).abs().max() < 1e-4

    class SwappedMLP(transformers.models.llama.modeling_llama.LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    config = transformers.LlamaConfig(**GQA)
    assert generic_fusion.mlp_activation(SwappedMLP(config), ("gate_proj", "up_proj")) is None
    assert generic_fusion.mlp_activation(transformers.models.llama.modeling_llama.LlamaMLP(config),
                                         ("gate_proj", "up_proj")) == "silu"
    relu = TransformersCausalLM.wrap(transformers.LlamaForCausalLM(transformers.LlamaConfig(**GQA, hidden_act="relu")))
    assert relu.fusions.mlps == 0 and relu.fusions.norms == 9


def test_an_optimizer_step_reaches_the_fused_forward(kernels):
    """Training forwards keep the modules' own (no kernel runs with gradients); after an AdamW step the fused
    forward reads the new weights (fusion.py's shared buffers, updated in place), equal to the unfused forward."""
    _, model = build("llama")
    model.fuse_projections()
    torch.manual_seed(3)
    tokens = torch.randint(1, VOCAB, (2, 9))
    before = cached_logits(model, tokens, fused=True)
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=1e-2)
    model.train()
    counts = dict(kernels)
    with fused_kernels(True, compile=False):  # even with the switch on, a forward with gradients is the modules'
        loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    assert kernels == counts
    model.eval()
    assert all(group.current() for group in model.fusions.groups)
    after = cached_logits(model, tokens, fused=True)
    model.fusions.on = False
    assert relative(after, cached_logits(model, tokens, fused=True)) < 1e-5
    assert relative(after, before) > 1e-2
    assert [id(p) for p in model.parameters()] == [id(p) for p in parameters]


def test_lora_layers_keep_their_own_forwards(kernels):
    """LoRA adapters on q, v and gate: those groups no longer fuse (the adapters would be skipped); the fused
    forward still equals the unfused one, adapters included."""
    import peft

    from cohort_grpo.models.lora import apply_lora

    _, model = build("llama")
    apply_lora(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False))
    model.fuse_projections()
    assert not any(group.current() for group in model.fusions.groups)
    torch.manual_seed(4)
    tokens = torch.randint(1, VOCAB, (2, 8))
    fused = cached_logits(model, tokens, fused=True)
    model.fusions.on = False
    assert relative(fused, cached_logits(model, tokens, fused=True)) < 1e-5


@pytest.mark.skipif(not ON_CUDA, reason="bfloat16 rounding as a GPU's; the interpreter's differs")
@pytest.mark.parametrize("variant", generic_fusion.NORM_VARIANTS)
def test_kernels_compute_their_references_on_cuda(variant):
    """In bfloat16 on CUDA the norm kernel of each variant rounds as its torch reference (bits, but for an ulp where
    the reduction orders round apart), and act(gate)·up as torch's activation times up within a rounding."""
    generator = torch.Generator("cuda").manual_seed(0)
    x, weight = (torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16)
                 for shape in ((256, 896), (896,)))
    ours = norm_kernels.rms_norm_kernel(x, weight, 1e-6, *variant)
    reference = norm_kernels.rms_norm_variant_plain(x, weight, 1e-6, *variant)
    assert ours.dtype == reference.dtype and (ours != reference).float().mean() < 1e-3
    gate, up = torch.randn(256, 2 * 4864, generator=generator, device="cuda", dtype=torch.bfloat16).chunk(2, dim=-1)
    for activation, fn in gate_kernels.GATED_ACTIVATIONS.items():
        expected = fn(gate.float()) * up.float()
        assert relative(gate_kernels.gated_activation_kernel(gate, up, activation).float(), expected) < 4e-3


def interleaved_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """Rotary of the interleaved convention (pairs 2i, 2i+1), not transformers' rotate-half."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotated(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    return q * cos + rotated(q) * sin, k * cos + rotated(k) * sin


def modeling_module(model):
    return sys.modules[type(model.decoder.layers[0].self_attn).__module__]


@pytest.mark.parametrize("model_type", ["gemma3_text", "llama", "olmo2", "qwen2", "smollm3"])
def test_rotary_kernel_equals_transformers_rotary(model_type, kernels):
    """The modeling module's rotary runs as the kernel (one call for q, one for k, per attention layer and forward)
    on the sampling path only: the logits equal those of the same model with only the rotary left to transformers,
    and a forward with gradients or off the sampling path never calls it."""
    reference, model = build(model_type)
    model.fuse_projections()
    dispatch = modeling_module(model).apply_rotary_pos_emb
    assert isinstance(dispatch, generic_rotary.RotaryDispatch) and model.fusions.rotaries == 1
    torch.manual_seed(5)
    tokens = torch.randint(1, VOCAB, (2, 9))
    before = kernels["rotate"]
    fused = cached_logits(model, tokens, fused=True)
    layers = sum(getattr(reference.config, "no_rope_layers", [1] * reference.config.num_hidden_layers))  # SmolLM3's
    assert kernels["rotate"] - before == (1 + tokens.shape[1] - 6) * 2 * layers
    counted = kernels["rotate"]
    served = model.fusions.rotary_modules
    model.fusions.rotary_modules = frozenset()  # every other fusion as it was
    unrotated = cached_logits(model, tokens, fused=True)
    assert kernels["rotate"] == counted and relative(fused, unrotated) < 1e-5
    model.fusions.rotary_modules = served
    cached_logits(model, tokens, fused=False)
    model.train()
    with fused_kernels(True, compile=False):
        model(tokens).sum().backward()
    assert kernels["rotate"] == counted
    with torch.no_grad(), fused_kernels(True, compile=False):  # transformers' own model, not wrapped: the original
        assert torch.equal(reference(tokens).logits, reference(tokens).logits)
    assert kernels["rotate"] == counted


def test_a_wrong_rotary_convention_is_refused(kernels, monkeypatch):
    """A modeling module whose rotary pairs interleaved dimensions keeps its function; transformers' own passes."""
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(**GQA)
    head_dim = config.hidden_size // config.num_attention_heads
    shapes = (config.num_attention_heads, config.num_key_value_heads, head_dim, torch.device("cpu"))
    current = modeling_llama.apply_rotary_pos_emb
    original = getattr(current, "original", current)
    assert generic_rotary.rotary_agrees(original, *shapes)
    assert not generic_rotary.rotary_agrees(interleaved_rotary, *shapes)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", interleaved_rotary)
    _, model = build("llama")
    assert model.fusions.rotaries == 0 and modeling_llama.apply_rotary_pos_emb is interleaved_rotary
    before = kernels["rotate"]
    cached_logits(model, torch.randint(1, VOCAB, (2, 8)), fused=True)
    assert kernels["rotate"] == before


def test_a_second_model_shares_the_one_dispatch(kernels):
    """Two models of one class: the modeling module's rotary is wrapped once, and each model's forwards (its copy's
    too, as a reference policy's) are served by it, each under its own switch."""
    _, first = build("llama")
    dispatch = modeling_module(first).apply_rotary_pos_emb
    _, second = build("llama", seed=1)
    copied = copy.deepcopy(second)
    assert modeling_module(second).apply_rotary_pos_emb is dispatch
    assert not isinstance(dispatch.original, generic_rotary.RotaryDispatch)
    tokens = torch.randint(1, VOCAB, (2, 7))
    for model in (first, second, copied):
        before = kernels["rotate"]
        cached_logits(model, tokens, fused=True)
        assert kernels["rotate"] - before == 2 * 2 * model.config.num_hidden_layers
    first.fusions.on = False
    before = kernels["rotate"]
    cached_logits(first, tokens, fused=True)
    assert kernels["rotate"] == before
    cached_logits(copied, tokens, fused=True)
    assert kernels["rotate"] > before


@pytest.mark.skipif(not ON_CUDA, reason="bfloat16 rounding as a GPU's; the interpreter's differs")
def test_rotary_kernel_computes_transformers_rotary_on_cuda():
    """In bfloat16 on CUDA the rotary kernel gives transformers' rotate-half rotary within a rounding (the kernel
    rounds once, transformers' each product)."""
    from transformers.models.llama import modeling_llama

    current = modeling_llama.apply_rotary_pos_emb
    original = getattr(current, "original", current)
    generator = torch.Generator("cuda").manual_seed(0)
    q, k = (torch.randn(4, heads, 1, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
            for heads in (14, 2))
    angles = torch.rand(4, 1, 64, generator=generator, device="cuda") * 100
    cos, sin = (torch.cat((t, t), dim=-1).bfloat16() for t in (angles.cos(), angles.sin()))
    for ours, own in zip(generic_fusion.rotary_kernel(q, k, cos, sin), original(q, k, cos, sin)):
        assert ours.dtype == own.dtype and relative(ours.float(), own.float()) < 4e-3
