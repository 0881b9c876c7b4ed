"""Memory one phase of the step leaves idle, used by another: gradients that live in the engine's KV
cache during the update (cohort_grpo/memory/lending.py), π_ref's weights on the host outside its pass
(cohort_grpo/memory/offload.py). Both must leave the training unchanged, bit for bit."""

import contextlib

import pytest
import torch

import cohort_grpo.memory.manager as update_module  # where the update borrows its gradients' storage
from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.memory.lending import lend_gradients
from cohort_grpo.memory.offload import HostOffload

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 9) for b in range(1, 4)]


def distinct_chars(completions, **kwargs):
    return [len(set(c)) / 10 for c in completions]


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(dtype)


def _accumulated_grads(model, batches):
    for x in batches:
        model(x).square().sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _inside(tensor, buffers):
    start = tensor.data_ptr()
    return any(b.data_ptr() <= start and start + tensor.numel() * tensor.element_size()
               <= b.data_ptr() + b.numel() * b.element_size() for b in buffers)


# ---- lend_gradients --------------------------------------------------------------------------------

def test_lent_gradients_accumulate_like_ordinary_ones_and_the_buffers_come_back_zeroed():
    batches = [torch.randn(5, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = _accumulated_grads(_mlp(), batches)

    model = _mlp()
    # Largest first, each at the first 256-byte boundary with room: the 40×6 weight (960 bytes) at
    # 0 of the 1,200-byte buffer, the 3×40 weight (480) nowhere, the 40-bias (160) at 1,024, the
    # 3-bias (12) at 0 of the 100-byte buffer.
    buffers = [torch.full((300,), 7.0), torch.full((25,), 7.0)]
    with lend_gradients(model.parameters(), buffers) as lent:
        assert [p.grad is None or not p.grad.any() for p in model.parameters()] == [True] * 4  # zeroed, not 7s
        assert [p.grad is None for p in model.parameters()] == [False, False, True, False]
        got = _accumulated_grads(model, batches)
        in_buffers = [_inside(p.grad, buffers) for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # bit for bit: 0 + g is g
    assert in_buffers == [True, True, False, True]  # weight 0, bias 0, weight 1, bias 1
    assert lent == 1184 + 12
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(buffers[0], torch.cat([torch.zeros(296), torch.full((4,), 7.0)]))  # used bytes zeroed
    assert torch.equal(buffers[1], torch.cat([torch.zeros(3), torch.full((22,), 7.0)]))


def test_a_parameter_that_fits_no_buffer_gets_an_ordinary_gradient():
    model = _mlp()
    small = [torch.zeros(80)]  # 320 bytes: only the biases fit (160 bytes at 0, 12 at 256)
    with lend_gradients(model.parameters(), small):
        model(torch.randn(2, 6)).sum().backward()
        placed = [_inside(p.grad, small) for p in model.parameters()]
    assert placed == [False, True, False, True]
    assert small[0].count_nonzero() == 0


def test_bf16_gradients_live_in_a_buffer_of_another_dtype():
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(2)]
    want = _accumulated_grads(_mlp(dtype=torch.bfloat16), batches)
    model = _mlp(dtype=torch.bfloat16)
    buffers = [torch.zeros(2000, dtype=torch.float32)]
    with lend_gradients(model.parameters(), buffers):
        got = _accumulated_grads(model, batches)
        assert all(_inside(p.grad, buffers) for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert buffers[0].count_nonzero() == 0


def test_lending_refuses_parameters_that_already_hold_gradients():
    model = _mlp()
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        with lend_gradients(model.parameters(), [torch.zeros(1000)]):
            pass


def test_lent_gradients_are_dropped_when_the_block_raises():
    model = _mlp()
    buffers = [torch.zeros(2000)]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with lend_gradients(model.parameters(), buffers):
            model(torch.randn(2, 6)).sum().backward()
            raise torch.cuda.OutOfMemoryError("simulated")
    assert all(p.grad is None for p in model.parameters()) and buffers[0].count_nonzero() == 0


def test_inference_tensors_lend_nothing():
    with torch.inference_mode():
        cache = torch.zeros(1000)  # cannot be written outside inference mode
    model = _mlp()
    with lend_gradients(model.parameters(), [cache]) as lent:
        model(torch.randn(2, 6)).sum().backward()
        assert lent == 0 and not any(_inside(p.grad, [cache]) for p in model.parameters())


# ---- HostOffload -----------------------------------------------------------------------------------

def test_offloaded_weights_leave_the_device_and_come_back_exactly():
    model = _mlp()
    x = torch.randn(3, 6)
    want = model(x)
    offload = HostOffload(model)
    assert offload.nbytes() == sum(p.numel() * 4 for p in model.parameters())
    with offload.on_device():
        assert torch.equal(model(x), want)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # freed
    with pytest.raises(CohortError, match=r"reference_pass\(\), or pass offload_ref_model=False"):
        model(x)  # refused before any kernel reads the freed storage (on a GPU, an illegal access)
    offload.prefetch()
    with offload.on_device():
        assert torch.equal(model(x), want)


def test_restore_brings_the_weights_back_until_the_next_pass():
    """What a run ends with: π_ref whole again, so code after train() reads weights, not a freed storage."""
    model = _mlp()
    x = torch.randn(3, 6)
    want = model(x)
    offload = HostOffload(model)
    with offload.on_device():
        pass
    offload.restore()
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in model.parameters())
    assert torch.equal(model(x), want)  # no reference_pass needed
    with offload.on_device():
        pass
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # the next pass evicts again


def test_a_write_inside_on_device_modified_reaches_the_host_copy():
    model, other = _mlp(0), _mlp(1)
    offload = HostOffload(model)
    with offload.on_device():
        pass  # first eviction: the host copy is made
    with offload.on_device(modified=True):
        model.load_state_dict(other.state_dict())
    with offload.on_device():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_a_write_that_raises_keeps_the_weights_on_the_device_and_the_next_eviction_saves_them():
    model, other = _mlp(0), _mlp(1)
    offload = HostOffload(model)
    with offload.on_device():
        pass
    with pytest.raises(RuntimeError, match="half-way"):
        with offload.on_device(modified=True):
            model[0].weight.data.copy_(other[0].weight)
            raise RuntimeError("failed half-way")
    assert offload.resident and model[0].weight.untyped_storage().nbytes() > 0
    with offload.on_device():
        pass  # leaving evicts: the host copy must take the written weight first
    with offload.on_device():
        assert torch.equal(model[0].weight, other[0].weight)


def test_tied_weights_are_offloaded_once():
    embed = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleList([embed, head])
    offload = HostOffload(model)
    assert len(offload.storages) == 1 and offload.nbytes() == 160
    before = embed.weight.detach().clone()
    with offload.on_device():
        pass
    with offload.on_device():
        assert torch.equal(head.weight, before) and head.weight is embed.weight


def test_disabled_offload_changes_nothing():
    model = _mlp()
    offload = HostOffload(model, enabled=False)
    with offload.on_device():
        pass
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert HostOffload(None).enabled is False


# ---- in the trainer --------------------------------------------------------------------------------

def _train(tiny_dir, tmp_path, offload=False, **overrides):
    options = dict(num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                   max_completion_length=8, max_steps=3, learning_rate=3e-3, output_dir=str(tmp_path), quiet=True,
                   seed=0, beta=0.04, ref_reset_steps=2, save_steps=2, device="cpu")  # bit-exact comparisons
    options.update(overrides)
    trainer = GRPOTrainer(tiny_dir, distinct_chars, PROMPTS, args=GRPOConfig(**options))
    if offload:  # the trainer offloads on CUDA only; the mechanism is the same on the CPU
        trainer.memory.ref_offload = HostOffload(trainer.ref_model)
    trainer.train()
    return trainer


@pytest.mark.slow
def test_training_with_lent_gradients_and_offloaded_reference_is_bit_for_bit_the_same(tiny_dir, tmp_path, monkeypatch):
    lent_bytes = []
    real = update_module.lend_gradients

    @contextlib.contextmanager
    def recording(params, buffers):
        with real(params, buffers) as lent:
            lent_bytes.append(lent)
            yield lent

    monkeypatch.setattr(update_module, "lend_gradients", recording)
    plain = _train(tiny_dir, tmp_path / "plain", lend_kv_cache=False)
    assert plain.memory.ref_offload.enabled is False  # CPU: the trainer does not offload by itself
    borrowed = _train(tiny_dir, tmp_path / "borrowed", offload=True)
    assert lent_bytes[:3] == [0, 0, 0] and all(n > 0 for n in lent_bytes[3:]) and len(lent_bytes) == 6  # one per update
    for a, b in zip(plain.model.parameters(), borrowed.model.parameters()):
        assert torch.equal(a, b)
    assert all(r["memory/lent_gib"] == 0 for r in plain.history)
    assert all(r["memory/lent_gib"] * 2**30 == n for r, n in zip(borrowed.history, lent_bytes[3:]))
    assert all(not b.is_inference() for b in borrowed.sampler.idle_buffers())  # the engine's cache can be lent
    assert [r["reward"] for r in plain.history] == [r["reward"] for r in borrowed.history]
    # the reference was reset at step 3 (ref_reset_steps=2) and saved at steps 2 and 3 while offloaded
    assert borrowed.memory.ref_offload.host is not None  # it was evicted between passes ...
    for a, b in zip(plain.ref_model.parameters(), borrowed.ref_model.parameters()):
        assert torch.equal(a, b)  # ... and the end of the run brought it back whole
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "borrowed" / "checkpoint-3" / "reference.safetensors"))
    want = {k: v for k, v in plain.ref_model.state_dict().items()}
    assert saved and all(torch.equal(saved[k], want[k]) for k in saved)
