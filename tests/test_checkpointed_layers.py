"""gradient_checkpointing_layers=auto (cohort_grpo/memory/checkpointed_layers.py): the decision against hand arithmetic, the
probe's measurement, the trainer's wiring (measure in the first update, decide before the second,
recompute everything on running out of memory), its errors, and on a GPU the probe against the
memory a kept layer really holds."""

import pytest
import torch

from cohort_grpo import GRPOConfig
from cohort_grpo.config.command_line import parse_config
from cohort_grpo.errors import CohortError
from cohort_grpo.memory.checkpointed_layers import ActivationProbe, AutoCheckpointing, layers_to_keep
from helpers import synthetic_batch, update_trainer
from update_gradients import update_gradient

GIB = 2**30
def test_layers_to_keep_worked_example_scaling_and_clamps():
    per_token = 1.18 * GIB / 16_896  # the 1.5B shape: 1.18 GiB a kept layer at 16,896 tokens
    assert layers_to_keep(28, 29.5 * GIB, 1, per_token, 16_896, 16_896, 36.0 * GIB) == 6  # 1 + ⌊6.5 / 1.18⌋
    # Measured at half the largest micro-batch: what grows with it is scaled first. 8,448 more tokens
    # × (28 boundaries × 3,072 bytes + the kept layer + one in flight, 2 × 75 KB) = 1.86 GiB:
    # 1 + ⌊(36.0 − 29.5 − 1.86) / 1.18⌋ = 4, where the unscaled peak would give 6.
    growth = 8_448 * (28 * 3_072 + 2 * per_token)
    assert 1 + int((36.0 * GIB - 29.5 * GIB - growth) // (1.18 * GIB)) == 4
    assert layers_to_keep(28, 29.5 * GIB, 1, per_token, 8_448, 16_896, 36.0 * GIB, 3_072) == 4
    # Scaled past the budget by the boundaries alone (no kept layer at all then).
    assert layers_to_keep(28, 29.5 * GIB, 1, per_token, 8_448, 16_896, 31.0 * GIB, 3_072) == 0
    assert layers_to_keep(28, 29.5 * GIB, 1, per_token, 8_448, 16_896, 31.0 * GIB) == 1  # without them: 1 + ⌊0.32⌋
    assert layers_to_keep(28, 29.5 * GIB, 1, per_token, 16_896, 16_896, 29.0 * GIB) == 0  # over budget already
    assert layers_to_keep(28, 29.5 * GIB, 1, per_token, 16_896, 16_896, 1000 * GIB) == 28  # at most every layer
    assert layers_to_keep(28, 29.5 * GIB, 1, 0.0, 16_896, 16_896, 30 * GIB) == 28  # a layer that keeps nothing


def test_probe_counts_what_the_forward_leaves_less_its_output():
    readings = iter([1_000, 1_000 + 4_096 + 800, 5_000, 5_000 + 4_096 + 4_000])
    probe = ActivationProbe(lambda: next(readings))
    out = probe.around(lambda: torch.empty(1024), tokens=8)  # 4,096 bytes of output
    assert out.shape == (1024,) and probe.bytes_per_token == 100.0 and probe.tokens == 8
    probe.around(lambda: torch.empty(1024), tokens=20)  # 4,000 / 20 = 200 a token: the larger is kept
    assert probe.bytes_per_token == 200.0 and probe.tokens == 20


def _trainer(tiny_dir, tmp_path, **overrides):
    return update_trainer(tiny_dir, tmp_path, **{"gradient_checkpointing": True, "device": "cpu", **overrides})


def _batch(trainer):
    return synthetic_batch(trainer)


def _count_forwards(model):
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):  # a recomputation runs the layer's forward again
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_auto_on_cpu_recomputes_every_layer(tiny_dir, tmp_path):
    trainer = _trainer(tiny_dir, tmp_path, gradient_checkpointing_layers="auto")
    assert trainer.memory.auto_checkpointing is None  # no allocator to measure with
    assert trainer.model.gradient_checkpointing and trainer.model.checkpointed_layers is None


def test_auto_measures_in_the_first_update_and_decides_before_the_second(tiny_dir, tmp_path):
    """The wiring, with a stand-in for the GPU allocator: bytes saved for the backward while the
    probe runs (an independent count), plus the probe's output, which it subtracts again."""
    plain = _trainer(tiny_dir, tmp_path / "plain", gradient_checkpointing=False)
    trainer = _trainer(tiny_dir, tmp_path / "auto", gradient_checkpointing_layers="auto")
    model = trainer.model
    layers = len(model.model.layers)
    saved = {"bytes": 0}

    def allocated():
        return saved["bytes"]

    def pack(tensor):
        saved["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    trainer.memory.auto_checkpointing = AutoCheckpointing(model, layers, budget=10 * GIB, allocated=allocated, peak=lambda: 1 * GIB)
    assert model.checkpointed_layers == layers - 1
    calls = _count_forwards(model)
    batch = _batch(trainer)
    before = list(calls)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        want, _ = update_gradient(plain, batch)
        got, stats = update_gradient(trainer, batch)
    assert torch.allclose(want, got, atol=1e-6)  # what is recomputed never changes the gradient
    micro = stats["micro_batches"]
    assert [c - b for c, b in zip(calls, before)] == [2 * micro] * (layers - 1) + [micro]  # the last layer kept
    probe = trainer.memory.auto_checkpointing.probe
    assert probe.tokens > 0 and probe.bytes_per_token > 0 and stats["checkpointed_layers"] == layers - 1

    assert trainer.memory.auto_checkpointing.update_peak == 1 * GIB  # read when the measuring update ended
    lines = []
    trainer.log = lines.append
    max_tokens = trainer.memory.largest_micro_batch_tokens()
    assert max_tokens >= probe.tokens
    boundary = model.config.hidden_size * 4  # the tiny model runs in float32 here
    assert trainer.memory.auto_checkpointing.boundary_bytes_per_token == boundary
    keep = layers_to_keep(layers, 1.0 * GIB, 1, probe.bytes_per_token, probe.tokens, max_tokens, 10 * GIB, boundary)
    before = list(calls)
    got, stats = update_gradient(trainer, batch)
    assert stats["checkpointed_layers"] == layers - keep == model.checkpointed_layers
    assert [c - b for c, b in zip(calls, before)] == [2 * micro] * (layers - keep) + [micro] * keep
    assert len(lines) == 1 and f"{keep} of {layers} layers keep their activations" in lines[0]
    assert torch.allclose(want, got, atol=1e-6)
    update_gradient(trainer, batch)
    assert len(lines) == 1  # decided once


def test_out_of_memory_while_keeping_layers_recomputes_them_before_halving(tiny_dir, tmp_path, monkeypatch):
    import cohort_grpo.update.policy_update as update_module

    trainer = _trainer(tiny_dir, tmp_path, gradient_checkpointing_layers="auto")
    model = trainer.model
    layers = len(model.model.layers)
    trainer.memory.auto_checkpointing = AutoCheckpointing(model, layers, budget=10 * GIB, allocated=lambda: 0, peak=lambda: 0)
    real = update_module.micro_batch_policy_loss

    def limited(*args, **kwargs):  # "out of memory" while any layer keeps its activations
        if model.checkpointed_layers < layers:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(update_module, "micro_batch_policy_loss", limited)
    lines = []
    trainer.log = lines.append
    rows = trainer.memory.micro_rows
    stats = trainer.update(_batch(trainer))
    assert model.checkpointed_layers == layers and stats["checkpointed_layers"] == layers
    assert trainer.memory.micro_rows == rows and trainer.memory.oom_retries == 1  # the micro-batch did not halve
    assert any("checkpointing every layer from now on" in line for line in lines)
    assert trainer.memory.auto_checkpointing.decided  # and stays decided: no new measurement


@pytest.mark.parametrize("share", [True, False])
def test_largest_micro_batch_bounds_every_planned_micro_batch(tiny_dir, tmp_path, share):
    """The bound against the planner itself, on rollouts whose completions all reach the limit."""
    from cohort_grpo.rollout.layout import Layout
    from cohort_grpo.update.packing import pack

    trainer = _trainer(tiny_dir, tmp_path, share_prompt_prefix=share)
    G, P, C = trainer.args.num_generations, trainer.args.max_prompt_length, trainer.args.max_completion_length
    prompts = [[5] * P, [6] * (P - 3), [7] * P, [8] * 2, [9] * P, [10] * (P - 1), [11] * P, [12] * 3]
    prompt_ids = [p for p in prompts for _ in range(G)]
    mask = torch.ones(len(prompt_ids), C, dtype=torch.long)
    ids = torch.full((len(prompt_ids), C), 9)
    bound = trainer.memory.largest_micro_batch_tokens()
    layout = Layout(shared=share, group=G)
    sizes = [pack(prompt_ids, ids, mask, rows, trainer.pad_id, layout).input_ids.numel()
             for rows in layout.plan(prompt_ids, mask, trainer.memory.micro_rows, 0)]
    assert max(sizes) <= bound
    assert max(sizes) == bound  # tight here: two whole groups at the longest prompt and completion
    assert bound == (2 if share else 8) * P + 8 * C


def test_auto_options_parse_and_errors():
    config = parse_config(["--gradient_checkpointing", "true", "--gradient_checkpointing_layers", "auto",
                           "--max_memory_gib", "36"])
    assert config.gradient_checkpointing_layers == "auto" and config.max_memory_gib == 36.0
    assert parse_config(["--gradient_checkpointing", "true", "--gradient_checkpointing_layers", "20"]
                        ).gradient_checkpointing_layers == 20
    with pytest.raises(CohortError, match="gradient_checkpointing_layers='most' is not one of its values; pass a "
                                          "whole number or auto"):
        GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_layers="most").validate()
    with pytest.raises(CohortError, match="max_memory_gib=36 is only the budget of gradient_checkpointing_layers=auto"):
        GRPOConfig(gradient_checkpointing=True, max_memory_gib=36).validate()
    with pytest.raises(CohortError, match="max_memory_gib=-1"):
        GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_layers="auto", max_memory_gib=-1).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the probe reads the CUDA allocator")
def test_probe_on_the_gpu_equals_the_memory_a_kept_layer_holds():
    """Independent figure: memory held after a training forward with every layer recomputed, and
    with the last one kept; the difference is what that layer keeps for its backward."""
    from cohort_grpo.models import CausalLM
    from cohort_grpo.models.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    model = CausalLM(config).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, 512, (8, 512), device="cuda")
    model.gradient_checkpointing_enable()
    model(ids, return_hidden=True)  # one-time allocations first (cuBLAS's workspace: 32 MiB on an H100)
    held = []
    for recomputed in (4, 3):
        model.checkpointed_layers = recomputed
        start = torch.cuda.memory_allocated()
        hidden = model(ids, return_hidden=True)
        held.append(torch.cuda.memory_allocated() - start)
        del hidden
    probe = ActivationProbe(torch.cuda.memory_allocated)
    model.activation_probe, model.checkpointed_layers = probe, 3
    hidden = model(ids, return_hidden=True)
    del hidden
    measured = probe.bytes_per_token * 8 * 512
    one_hidden = 8 * 512 * 256 * 2  # bytes of one [8, 512, 256] bf16 activation, a layer keeps ~25 of them
    assert measured > 10 * one_hidden
    assert abs(measured - (held[1] - held[0])) <= one_hidden, (measured, held)
