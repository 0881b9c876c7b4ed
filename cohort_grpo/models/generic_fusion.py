"""Fewer kernels in a `TransformersCausalLM`'s decode step (generic.py): on the engine's sampling forwards,
transformers' RMSNorms run as one Triton kernel each, a gated MLP's gate and up as one GEMM and act(gate)·up as one
kernel, an attention's q, k and v as one GEMM, and the rotary of q and k (the modeling module's
`apply_rotary_pos_emb`) as one kernel each.

Written as torch ops, transformers' RMSNorm is six to eight kernels (upcast, square, mean, add, rsqrt, two products,
downcast), act(gate)·up two, rotate-half rotary about ten a layer, and q/k/v and gate/up separate GEMMs; at a
decode step each launch costs a few microseconds whatever its size, so a layer spends more on them than on its
arithmetic. cohort's own layers (decoder.py) compute each of these pieces as one; here the same kernels
(kernels/exact_rms_norm.py, kernels/exact_elementwise.py) and the same fused weights (fusion.py) serve
transformers' modules.

Each module keeps its class, its parameters and their names (state dicts, the optimizer's parameters, LoRA's targets,
FSDP's per-layer units are unchanged); only the instance's `forward` becomes a dispatcher (`FusedNorm`, `FusedMLP`,
`GroupedProjection`) that takes the fused computation on the sampling path (`fused_path()`: the engine's fused kernels
on and autograd off) and the module's own forward everywhere else: every training forward, the update's no-grad
log-probs, a forward given other arguments.

`install`, at wrap time, replaces a module only where a copy of it with random weights, on random input in float32,
gives what the replacement computes (relative error <= `CHECK_TOLERANCE`): a norm that scales by 1 + weight (Gemma) is
served by that variant and never by the plain one, and an MLP whose activation is neither SiLU nor GELU-tanh, or that
computes anything else, keeps its own forward. Where a norm rounds (the normalised row to the input's dtype before the
weight's product, as Llama's, or the product in float32, as OLMo 2's and Gemma's) is told apart in bfloat16. The
rotary is served likewise, by generic_rotary.py.

At each call a replacement runs only where it can: the kernels on CUDA with triton (`triton_allowed`); the fused GEMMs
once the engine has fused the weights (`Fusions.fuse`, from `TransformersCausalLM.fuse_projections` before it decodes
on CUDA, as for the native model: the parameters become slices of one buffer, which the optimizer's in-place updates
and resharding's in-place copies keep current) and while the projections are still the plain `nn.Linear`s they were
(LoRA's layers in their place keep their own forwards).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cohort_grpo.kernels import exact_elementwise, exact_rms_norm
from cohort_grpo.kernels.elementwise import fused_path, triton_allowed
from cohort_grpo.models.fusion import fused_weight

# Largest relative (L2) error of a replacement against the module it replaces, on random float32 input and weights.
CHECK_TOLERANCE = 1e-5
# The same in bfloat16 for norms: an ulp where the two reduction orders round apart passes, the other rounding point
# of the weight's product (an ulp on a good share of the elements) does not.
HALF_NORM_TOLERANCE = 3e-4
CHECK_ROWS = 16
EPS_NAMES = ("variance_epsilon", "eps")  # transformers' names of an RMSNorm's epsilon
GATE_UP_NAMES = (("gate_proj", "up_proj"), ("gate_up_proj",))  # separate projections, or Phi-3's joined one
QKV_NAMES = ("q_proj", "k_proj", "v_proj")


class NormVariant(NamedTuple):
    """Where an RMSNorm differs from Llama's (exact_rms_norm.rms_norm_kernel's arguments)."""

    one_plus_weight: bool  # scales by 1 + weight (Gemma)
    round_normed: bool  # the normalised row rounded to the input's dtype before the weight's product (Llama)


NORM_VARIANTS = tuple(NormVariant(one, rounded) for one in (False, True) for rounded in (True, False))


@dataclass
class Fusions:
    """What `install` replaced in one model, and `on`, the switch that turns every replacement off (a benchmark's
    comparison; decode graphs captured under one setting keep it)."""

    on: bool = True
    norms: int = 0
    mlps: int = 0
    attentions: int = 0
    rotaries: int = 0  # modeling modules whose `apply_rotary_pos_emb` runs as the kernel for this decoder
    rotary_modules: frozenset = frozenset()  # their names
    groups: list = field(default_factory=list, repr=False)  # the ProjectionGroups that `fuse` fuses

    def active(self) -> bool:
        return self.on and fused_path()

    def fuse(self) -> None:
        """Re-point each group's parameters into one buffer (fusion.py); call it outside inference mode."""
        for group in self.groups:
            group.fuse()


class ProjectionGroup:
    """Linear layers of one input (q/k/v of an attention, gate/up of an MLP), `names` of `owner`, as one GEMM once
    `fuse` has made their weights one matrix and while they are the plain `nn.Linear`s they were."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...], fusions: Fusions):
        self.owner, self.names, self.fusions = owner, names, fusions
        self.linears = [getattr(owner, name) for name in names]
        self.sizes = [getattr(linear, "out_features", 0) for linear in self.linears]
        self.weights: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.addresses: list[int] = []
        self.pending_input: torch.Tensor | None = None  # the input whose other outputs wait in `pending`
        self.pending: dict[int, torch.Tensor] = {}

    def in_place(self) -> bool:
        return all(getattr(self.owner, name) is linear and type(linear) is nn.Linear
                   for name, linear in zip(self.names, self.linears))

    def fuse(self) -> None:
        parameters = [p for linear in self.linears for p in linear.parameters()]
        if self.in_place() and all(type(p.data) is torch.Tensor for p in parameters):  # not FSDP's DTensors
            self.weights = fused_weight(self.linears)
            self.addresses = [p.data_ptr() for p in parameters]

    def current(self) -> bool:
        """Whether the fused matrix is theirs: fused, not replaced since (LoRA, another tensor assigned)."""
        return (self.weights is not None and self.in_place()
                and [p.data_ptr() for linear in self.linears for p in linear.parameters()] == self.addresses)

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection of x: one GEMM where current, else each layer as the owner holds it now."""
        if self.current():
            return list(F.linear(x, *self.weights).split(self.sizes, dim=-1))
        return [getattr(self.owner, name)(x) for name in self.names]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Projection `index` of x: the first of the group asked for x computes them all, the others take theirs."""
        if self.pending_input is not x or index not in self.pending:
            self.pending_input, self.pending = x, dict(enumerate(self.outputs(x)))
        output = self.pending.pop(index)
        if not self.pending:
            self.pending_input = None
        return output

    def __getstate__(self) -> dict:  # a copy (π_ref) holds no activations
        return dict(self.__dict__, pending_input=None, pending={})


class GroupedProjection:
    """A q/k/v projection's forward: its share of the group's one GEMM on the sampling path, else its own."""

    def __init__(self, group: ProjectionGroup, index: int, own_forward):
        self.group, self.index, self.own_forward = group, index, own_forward

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        group = self.group
        if args or kwargs or not (group.fusions.active() and group.current()):
            return self.own_forward(x, *args, **kwargs)
        return group.take(self.index, x)


def norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: NormVariant) -> torch.Tensor:
    """The norm as the kernel computes it: the kernel where triton runs, else its torch reference."""
    if triton_allowed(x):
        return exact_rms_norm.rms_norm_kernel(x, weight, eps, *variant)
    return exact_rms_norm.rms_norm_variant_plain(x, weight, eps, *variant)


class FusedNorm:
    """An RMSNorm's forward: the kernel on the sampling path (CUDA), else the module's own."""

    def __init__(self, module: nn.Module, own_forward, eps_name: str, variant: NormVariant, fusions: Fusions):
        self.module, self.own_forward, self.eps_name, self.variant = module, own_forward, eps_name, variant
        self.fusions = fusions

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        weight = self.module.weight
        if (args or kwargs or not self.fusions.active() or not triton_allowed(hidden_states)
                or hidden_states.shape[-1] != weight.shape[0]):
            return self.own_forward(hidden_states, *args, **kwargs)
        return exact_rms_norm.rms_norm_kernel(hidden_states, weight, getattr(self.module, self.eps_name),
                                              *self.variant)


def gated_mlp(module: nn.Module, x: torch.Tensor, activation: str, group: ProjectionGroup) -> torch.Tensor:
    """down(act(gate(x)) · up(x)): gate and up from `group` (one output: Phi-3's joined projection), act·up by the
    kernel where triton runs, else by its torch reference."""
    projected = group.outputs(x)
    gate, up = projected if len(projected) == 2 else projected[0].chunk(2, dim=-1)
    if triton_allowed(gate):
        hidden = exact_elementwise.gated_activation_kernel(gate, up, activation)
    else:
        hidden = exact_elementwise.GATED_ACTIVATIONS[activation](gate) * up
    return module.down_proj(hidden)


class FusedMLP:
    """A gated MLP's forward: `gated_mlp` on the sampling path, else the module's own."""

    def __init__(self, module: nn.Module, own_forward, activation: str, group: ProjectionGroup):
        self.module, self.own_forward, self.activation, self.group = module, own_forward, activation, group

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not self.group.fusions.active():
            return self.own_forward(x, *args, **kwargs)
        return gated_mlp(self.module, x, self.activation, self.group)


# ---- the wrap-time checks --------------------------------------------------------------------------------------
def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-30))


def norm_eps_name(module: nn.Module) -> str | None:
    """The name of an RMSNorm module's epsilon; None for a module that is not one with a weight vector."""
    weight = getattr(module, "weight", None)
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return None
    return next((name for name in EPS_NAMES if isinstance(getattr(module, name, None), float)), None)


@torch.no_grad()
def norm_variant(module: nn.Module, eps_name: str) -> NormVariant | None:
    """The `NormVariant` that computes `module` (a copy with random weights), or None: the kernel's value in float32
    within `CHECK_TOLERANCE`, and the variant's rounding points, in bfloat16, those of the module (against the
    kernel's torch reference: Triton's CPU interpreter does not round to bfloat16 as a GPU does)."""
    device, dim = module.weight.device, module.weight.shape[0]
    generator = torch.Generator(device).manual_seed(0)
    x, weight = (torch.randn(shape, generator=generator, device=device) for shape in ((CHECK_ROWS, dim), (dim,)))
    probe = copy.deepcopy(module).eval()
    own = {}
    for dtype in (torch.float32, torch.bfloat16):
        probe.weight = nn.Parameter(weight.to(dtype))
        own[dtype] = probe(x.to(dtype))
    eps = getattr(module, eps_name)
    half = (x.bfloat16(), weight.bfloat16(), eps)
    for variant in NORM_VARIANTS:
        ours, rounded = norm_kernel(x, weight, eps, variant), exact_rms_norm.rms_norm_variant_plain(*half, *variant)
        if (ours.dtype == own[torch.float32].dtype and rounded.dtype == own[torch.bfloat16].dtype
                and relative_error(ours, own[torch.float32]) <= CHECK_TOLERANCE
                and relative_error(rounded, own[torch.bfloat16]) <= HALF_NORM_TOLERANCE):
            return variant
    return None


def gate_up_names(module: nn.Module) -> tuple[str, ...] | None:
    """The names of a gated MLP's gate and up projections (layers, not a mixture's stacked expert weights)."""
    if not isinstance(getattr(module, "down_proj", None), nn.Module):
        return None
    return next((names for names in GATE_UP_NAMES
                 if all(isinstance(getattr(module, name, None), nn.Module) for name in names)), None)


@torch.no_grad()
def mlp_activation(module: nn.Module, names: tuple[str, ...]) -> str | None:
    """The activation (a `GATED_ACTIVATIONS` key) for which `gated_mlp` computes `module` (a float32 copy with
    random weights), or None."""
    probe = copy.deepcopy(module).float().eval()
    device = next(probe.parameters()).device
    generator = torch.Generator(device).manual_seed(0)
    for parameter in probe.parameters():
        scale = 1 / math.sqrt(parameter.shape[-1]) if parameter.dim() > 1 else 0.1
        parameter.copy_(torch.randn(parameter.shape, generator=generator, device=device) * scale)
    x = torch.randn(CHECK_ROWS, probe.down_proj.out_features, generator=generator, device=device)
    own = probe(x)
    group = ProjectionGroup(probe, names, Fusions())
    for activation in exact_elementwise.GATED_ACTIVATIONS:
        if relative_error(gated_mlp(probe, x, activation, group), own) <= CHECK_TOLERANCE:
            return activation
    return None


def checked(check, signature: tuple, memo: dict):
    """`check()`, once per signature (the layers of a model share their modules' classes and shapes); a check
    that raises is a refusal (None)."""
    if signature not in memo:
        try:
            memo[signature] = check()
        except Exception:  # noqa: BLE001 - a module this check cannot call is left alone
            memo[signature] = None
    return memo[signature]


def shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters())


def install(decoder: nn.Module) -> Fusions:
    """Put the dispatchers on `decoder`'s eligible modules (RMSNorms, gated MLPs, attentions with q/k/v projections of
    one input), each checked against the module first; returns what was replaced."""
    fusions, memo = Fusions(), {}
    for module in list(decoder.modules()):
        eps_name = norm_eps_name(module)
        if eps_name is not None:
            variant = checked(lambda: norm_variant(module, eps_name), (type(module), eps_name, shapes(module)), memo)
            if variant is not None:
                module.forward = FusedNorm(module, module.forward, eps_name, variant, fusions)
                fusions.norms += 1
            continue
        names = gate_up_names(module)
        if names is not None:
            act = getattr(module, "act_fn", getattr(module, "activation_fn", None))
            activation = checked(lambda: mlp_activation(module, names), (type(module), repr(act), shapes(module)),
                                 memo)
            if activation is not None:
                group = ProjectionGroup(module, names, fusions)
                module.forward = FusedMLP(module, module.forward, activation, group)
                fusions.groups.append(group)
                fusions.mlps += 1
            continue
        if all(type(getattr(module, name, None)) is nn.Linear for name in QKV_NAMES) \
                and len({getattr(module, name).in_features for name in QKV_NAMES}) == 1:
            group = ProjectionGroup(module, QKV_NAMES, fusions)
            for index, linear in enumerate(group.linears):
                linear.forward = GroupedProjection(group, index, linear.forward)
            fusions.groups.append(group)
            fusions.attentions += 1
    return fusions
