"""The fp32-master AdamW steps in chunks: same numbers as torch's AdamW over fp32 copies, with at
most one chunk of fp32 gradients alive; out of memory before a chunk changes anything halves the chunk
and the step goes on, exactly, and part-way through an update it stops the run instead of stepping twice."""

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cohort_grpo.optim.precision as precision
from cohort_grpo.errors import CohortError
from cohort_grpo.optim.precision import MasterWeightAdamW, _chunks_by_bytes, join_master, split_master
from cohort_grpo.optim.optimizer import clip_grad_norm

SHAPES = [(64, 32), (32,), (128, 16), (7,), (256, 8), (16, 16)]  # 2,048 + 32 + 2,048 + 7 + 2,048 + 256 elements


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16)) for shape in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(shape, generator=generator) * (1 + i)).to(torch.bfloat16) for i, shape in enumerate(SHAPES)]


KWARGS = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))


def _bf16_ties_away(values: torch.Tensor) -> torch.Tensor:
    """bf16 rounding to nearest with ties away from zero, by integer arithmetic on the fp32 patterns
    (independent of split_master): add half a bf16 unit to the magnitude's pattern, drop the low half."""
    bits = values.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign, magnitude = bits & 0x80000000, bits & 0x7FFFFFFF
    rounded = ((magnitude + 0x8000) >> 16) | (sign >> 16)
    return rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _from_patterns(patterns: list[int]) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_split_master_stores_fp32_exactly_in_the_bf16_weight_and_16_low_bits():
    torch.manual_seed(0)
    values = torch.randn(200_000) * torch.exp(torch.randn(200_000) * 8)  # many magnitudes, both signs
    ties = _from_patterns([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x80008000, 0x7F7E8000])
    edges = _from_patterns([0x3F807FFF, 0x3F80FFFF, 0x7F7F7FFF, 0x00000000, 0x80000000, 0x00000001, 0xBF80FFFF])
    masters = torch.cat([values, ties, edges])
    weight, low = torch.empty(masters.shape, dtype=torch.bfloat16), torch.empty(masters.shape, dtype=torch.int16)
    split_master(masters.clone(), weight, low)
    assert torch.equal(join_master(weight, low).view(torch.int32), masters.view(torch.int32))  # bit for bit
    assert torch.equal(weight.view(torch.int16), _bf16_ties_away(masters).view(torch.int16))
    # Off the ties that is torch's own rounding; the ties whose even neighbour is below differ by one unit.
    tie = (masters.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(weight[~tie], masters[~tie].to(torch.bfloat16))
    assert weight[-14:-7].view(torch.int16).tolist() == [0x3F81, 0x3F82, -0x407F, -0x407E, 0x0001, -0x7FFF, 0x7F7F]


def test_split_masters_save_two_bytes_a_parameter():
    params = _params()
    optimizer = MasterWeightAdamW(params, **KWARGS)
    stored = sum(m.numel() * m.element_size() for m in optimizer.masters)
    stored += sum(low.numel() * low.element_size() for low in optimizer.lows)
    assert stored == 2 * sum(p.numel() for p in params)  # a whole fp32 copy would be 4 a parameter
    fp16 = [torch.nn.Parameter(torch.randn(4, 4).half())]
    kept = MasterWeightAdamW(fp16, **KWARGS)  # fp16 is no fp32's top half: a whole master
    assert kept.lows == [None] and kept.masters[0].dtype == torch.float32 and kept.masters[0].shape == (4, 4)


def test_state_dict_round_trip_restores_exact_masters():
    params = _params()
    optimizer = MasterWeightAdamW(params, **KWARGS)
    for step in range(2):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        optimizer.step()
    buffer = io.BytesIO()  # through bytes, as a checkpoint goes: torch's state_dict() shares the live moments
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    assert all(m.dtype == torch.float32 for m in saved["master_weights"])
    fresh_params = _params(seed=1)  # other weights: everything must come from the checkpoint
    fresh = MasterWeightAdamW(fresh_params, **KWARGS)
    fresh.load_state_dict(saved)
    for a, b in zip(fresh.master_weights(), optimizer.master_weights()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(fresh_params, params))
    for p, g in zip(params + fresh_params, _grads(2) + _grads(2)):
        p.grad = g.clone()
    optimizer.step()
    fresh.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh.master_weights(), optimizer.master_weights()))


def test_chunks_cover_every_tensor_once_within_the_budget():
    tensors = [torch.empty(shape) for shape in SHAPES]
    for budget in (1, 4 * 2048, 4 * 2400, 4 * 5000, 1 << 30):
        chunks = _chunks_by_bytes(tensors, budget)
        assert [i for chunk in chunks for i in chunk] == list(range(len(tensors)))
        for chunk in chunks:
            size = sum(tensors[i].numel() * 4 for i in chunk)
            assert size <= budget or len(chunk) == 1  # only a tensor larger than the budget goes over it
    assert len(_chunks_by_bytes(tensors, 1)) == len(tensors)
    assert len(_chunks_by_bytes(tensors, 1 << 30)) == 1
    assert [list(c) for c in _chunks_by_bytes(tensors, 4 * 2400)] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("chunk_bytes", [1, 4 * 2400, 1 << 30])
def test_chunked_step_equals_torch_adamw_over_fp32_copies(chunk_bytes):
    """The independent computation: torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW on fp32
    copies of the weights and of the bf16 gradients, then rounded to bf16. Bit for bit."""
    params = _params()
    optimizer = MasterWeightAdamW(params, chunk_bytes=chunk_bytes, **KWARGS)
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    plain = torch.optim.AdamW(reference, **KWARGS)
    for step in range(4):
        for p, r, g in zip(params, reference, _grads(step)):
            p.grad, r.grad = g.clone(), g.float()
        max_norm = 5.0 if step % 2 == 0 else 1e6  # clipping on, then off (coefficient clamped to 1)
        norm = clip_grad_norm(optimizer, torch.nn.Module(), max_norm)
        want_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)
        assert torch.equal(norm, want_norm)
        optimizer.step()
        plain.step()
        for p, m, r, placeholder in zip(params, optimizer.master_weights(), reference, optimizer.masters):
            assert torch.equal(m, r.detach())
            assert torch.equal(p.detach(), _bf16_ties_away(r.detach()))
            assert p.grad is None and placeholder.grad is None and placeholder.numel() == 0  # stored split
    assert norm > 5.0  # the clipped steps really clipped
    for m, r in zip(optimizer.masters, reference):  # the state is keyed by the (placeholder) masters
        for key in ("step", "exp_avg", "exp_avg_sq"):
            ours, theirs = optimizer.state[m][key], plain.state[r][key]
            assert ours.dtype == theirs.dtype and ours.device == theirs.device and torch.equal(ours, theirs)


def test_a_chunks_fp32_copies_are_gone_before_the_next_chunk_makes_its_own(monkeypatch):
    """Weak references to every fp32 gradient and rebuilt master the norm and the step make: when a
    chunk makes its copies, none of an earlier chunk's may still be alive (two chunks at once would
    double the step's transient memory, which is what the chunks are for)."""
    import weakref

    params = _params()
    optimizer = MasterWeightAdamW(params, chunk_bytes=4 * 2400, **KWARGS)
    made: list[weakref.ref] = []
    alive_at_each_chunk: list[int] = []
    fp32_grads, join = MasterWeightAdamW._fp32_grads, precision.join_master

    def spy_grads(self, indices):
        alive_at_each_chunk.append(sum(ref() is not None for ref in made))
        out = fp32_grads(self, indices)
        made.extend(weakref.ref(g) for g in out)
        return out

    def spy_join(weight, low):
        out = join(weight, low)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(MasterWeightAdamW, "_fp32_grads", spy_grads)
    monkeypatch.setattr(precision, "join_master", spy_join)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    clip_grad_norm(optimizer, torch.nn.Module(), 1.0)
    optimizer.step()
    assert alive_at_each_chunk == [0] * 6  # three chunks for the norm, three for the step


def test_no_more_than_one_chunk_of_fp32_gradients_is_alive(monkeypatch):
    params = _params()
    budget = 4 * 2400
    optimizer = MasterWeightAdamW(params, chunk_bytes=budget, **KWARGS)
    alive: list[int] = []
    adamw_step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        alive.append(sum(m.grad.numel() * 4 for m in self.masters if m.grad is not None))
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    clip_grad_norm(optimizer, torch.nn.Module(), 1.0)
    optimizer.step()
    assert alive == [2080 * 4, 2055 * 4, 2304 * 4]  # three chunks, each stepped alone
    assert max(alive) <= budget < sum(t.numel() * 4 for t in params)


def test_moments_exist_from_construction():
    """The optimizer's memory is all there before the first update, so that update's peak is the
    steady one."""
    params = _params()
    optimizer = MasterWeightAdamW(params, **KWARGS)
    for master, param in zip(optimizer.masters, params):
        state = optimizer.state[master]
        assert float(state["step"]) == 0.0
        assert torch.equal(state["exp_avg"], torch.zeros(param.shape))
        assert torch.equal(state["exp_avg_sq"], torch.zeros(param.shape))


def test_out_of_memory_in_the_step_changes_nothing(monkeypatch):
    """Moments dropped since construction (LoRA's π_ref reset drops B's) come back for every master
    before any chunk steps, so a failure to allocate them leaves masters, weights and state
    untouched, and the retried step is exact."""
    params = _params()
    optimizer = MasterWeightAdamW(params, chunk_bytes=4 * 2400, **KWARGS)
    for master in optimizer.masters[1:]:
        optimizer.state.pop(master)
    before = [p.detach().clone() for p in params]
    masters_before = optimizer.master_weights()
    zeros_like = torch.zeros_like
    calls = {"n": 0}

    def failing_zeros_like(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:  # the fifth master's moments: after the first chunk's would have been made
            raise torch.OutOfMemoryError("simulated")
        return zeros_like(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros_like", failing_zeros_like)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(torch.equal(m, b) for m, b in zip(optimizer.master_weights(), masters_before))
    monkeypatch.setattr(torch, "zeros_like", zeros_like)

    optimizer.zero_grad()  # what the trainer's retry starts from: no step was taken
    for p, g in zip(params, _grads(0)):
        p.grad = g
    optimizer.step()
    reference = [torch.nn.Parameter(b.float()) for b in before]
    plain = torch.optim.AdamW(reference, **KWARGS)
    for r, g in zip(reference, _grads(0)):
        r.grad = g.float()
    plain.step()
    assert all(torch.equal(m, r.detach()) for m, r in zip(optimizer.master_weights(), reference))


def _failing_on_call(real, call: int):
    """`real`, except that its `call`-th call raises a CUDA out-of-memory error (as the allocator would)."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)
    return wrapper


def _plain_adamw_steps(before: list[torch.Tensor], steps: int, max_norm: float) -> list[torch.nn.Parameter]:
    reference = [torch.nn.Parameter(b.float()) for b in before]
    plain = torch.optim.AdamW(reference, **KWARGS)
    for step in range(steps):
        for r, g in zip(reference, _grads(step)):
            r.grad = g.float()
        torch.nn.utils.clip_grad_norm_(reference, max_norm)
        plain.step()
    return reference


def test_out_of_memory_in_a_later_chunk_halves_it_and_the_step_goes_on_exactly(monkeypatch):
    """Chunks [0, 1], [2, 3], [4, 5]; rebuilding master 2 fails. Chunk [0, 1] has stepped by then, so
    the update cannot be retried whole: the failed chunk is halved (8,220 → 4,110 bytes a chunk) and
    the step finishes from tensor 2. The result is torch's AdamW, bit for bit, in that step and the next."""
    params = _params()
    before = [p.detach().clone() for p in params]
    optimizer = MasterWeightAdamW(params, chunk_bytes=4 * 2400, **KWARGS)
    monkeypatch.setattr(precision, "join_master", _failing_on_call(precision.join_master, 3))
    for step in range(2):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        clip_grad_norm(optimizer, torch.nn.Module(), 5.0)
        optimizer.step()
    assert optimizer.chunk_shrinks == 1 and optimizer.chunk_bytes == (2048 + 7) * 4 // 2
    assert [list(c) for c in optimizer.chunks] == [[0], [1], [2], [3], [4], [5]]  # kept for the later steps
    reference = _plain_adamw_steps(before, 2, 5.0)
    for p, m, r in zip(params, optimizer.master_weights(), reference):
        assert torch.equal(m, r.detach())
        assert torch.equal(p.detach(), _bf16_ties_away(r.detach()))


def test_out_of_memory_for_the_first_tensor_propagates_with_nothing_changed(monkeypatch):
    """One tensor a chunk and the very first cannot get its memory: nothing has stepped, so the
    error goes up as it is, for the trainer to retry the whole update."""
    params = _params()
    before = [p.detach().clone() for p in params]
    optimizer = MasterWeightAdamW(params, chunk_bytes=1, **KWARGS)
    monkeypatch.setattr(precision, "join_master", _failing_on_call(precision.join_master, 1))
    for p, g in zip(params, _grads(0)):
        p.grad = g
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(float(optimizer.state[m]["step"]) == 0 for m in optimizer.masters)
    assert all(torch.count_nonzero(low) == 0 for low in optimizer.lows)


@pytest.mark.parametrize("where", ["one tensor left", "inside the update"])
def test_out_of_memory_after_tensors_stepped_stops_the_run_rather_than_step_them_twice(monkeypatch, where):
    """A trainer that caught an out-of-memory error here would rerun the update over weights that
    are part stepped. So the step raises a CohortError (not an out-of-memory error: no retry) that
    says how far it got and what to do."""
    params = _params()
    optimizer = MasterWeightAdamW(params, chunk_bytes=1, **KWARGS)
    if where == "one tensor left":  # the third tensor's master cannot be rebuilt, even alone
        monkeypatch.setattr(precision, "join_master", _failing_on_call(precision.join_master, 3))
    else:  # the third chunk's fused update itself
        monkeypatch.setattr(torch.optim.AdamW, "step", _failing_on_call(torch.optim.AdamW.step, 3))
    for p, g in zip(params, _grads(0)):
        p.grad = g
    with pytest.raises(CohortError, match=r"part-way through the optimizer step \(2 of 6 tensors updated\)") as error:
        optimizer.step()
    assert not isinstance(error.value, torch.OutOfMemoryError)
    assert "resume=True" in str(error.value) and "\n" not in str(error.value)
    assert [float(optimizer.state[m]["step"]) for m in optimizer.masters] == [1, 1, 0, 0, 0, 0]


PART_WAY_ALONE = textwrap.dedent("""
    import torch

    import cohort_grpo.optim.precision as precision

    params = [torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16)) for _ in range(3)]
    optimizer = precision.MasterWeightAdamW(params, chunk_bytes=1, lr=1e-2)
    join_master, calls = precision.join_master, []

    def third_call_out_of_memory(*args):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return join_master(*args)

    precision.join_master = third_call_out_of_memory
    for p in params:
        p.grad = torch.ones_like(p)
    try:
        optimizer.step()
    except Exception as error:
        print(type(error).__name__, error)
""")


def test_the_part_way_error_reads_as_python_in_an_interpreter_that_imported_only_the_optimizer():
    """A fresh interpreter that imports this module and nothing else of cohort (no GRPOConfig, which teaches the
    errors a Python caller's spelling) still shows the error in keywords: what a caller imported first, or which
    test ran before, does not change a message."""
    done = subprocess.run([sys.executable, "-c", PART_WAY_ALONE], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("CohortError out of GPU memory part-way through the optimizer step (2 of 3"), line
    assert "resume=True" in line and "max_memory_gib" in line and "--" not in line, line


def test_a_step_skipped_after_clipping_leaves_no_coefficient_behind():
    params = _params()
    optimizer = MasterWeightAdamW(params, **KWARGS)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    p.grad[0, 0] = float("nan")
    assert torch.isnan(clip_grad_norm(optimizer, torch.nn.Module(), 1.0))
    optimizer.zero_grad()  # the trainer's run guard skips a non-finite update this way
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    plain = torch.optim.AdamW(reference, **KWARGS)
    for p, r, g in zip(params, reference, _grads(1)):
        p.grad, r.grad = g.clone(), g.float()
    optimizer.step()  # no clipping asked: a NaN coefficient left from before would poison it
    plain.step()
    assert all(torch.equal(m, r.detach()) for m, r in zip(optimizer.master_weights(), reference))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fused AdamW kernel and _foreach_norm on the device")
def test_chunked_fused_step_on_the_gpu_equals_torch_fused_adamw():
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    optimizer = MasterWeightAdamW(params, chunk_bytes=4 * 2400, **KWARGS)
    assert optimizer.defaults["fused"] and len(optimizer.chunks) == 3
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    plain = torch.optim.AdamW(reference, fused=True, **KWARGS)
    for step in range(3):
        for p, r, g in zip(params, reference, _grads(step)):
            p.grad, r.grad = g.cuda(), g.float().cuda()
        assert torch.equal(clip_grad_norm(optimizer, torch.nn.Module(), 5.0),
                           torch.nn.utils.clip_grad_norm_(reference, 5.0))
        optimizer.step()
        plain.step()
    assert all(torch.equal(m, r.detach()) for m, r in zip(optimizer.master_weights(), reference))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a real out-of-memory error from the caching allocator")
def test_a_real_out_of_memory_error_on_the_gpu_halves_the_chunks_and_the_step_is_exact():
    """Four bf16 tensors of 2^26 elements: a chunk's scratch is 9 bytes an element (fp32 gradient and
    master, the tie mask), 576 MiB a tensor. The process may allocate 850 MiB beyond what the optimizer
    holds, so the 1 GiB chunk (all four) and then two tensors fail, and one at a time fits."""
    n = 1 << 26
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device="cuda").to(torch.bfloat16)) for _ in range(4)]
    before = [p.detach().float() for p in params]
    optimizer = MasterWeightAdamW(params, chunk_bytes=1 << 30, **KWARGS)
    grads = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(4)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + (850 << 20)) / total)
    try:
        optimizer.step()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert optimizer.chunk_shrinks == 2 and optimizer.chunk_bytes == (1 << 30) // 4
    reference = [torch.nn.Parameter(b) for b in before]
    plain = torch.optim.AdamW(reference, fused=True, **KWARGS)
    for r, g in zip(reference, grads):
        r.grad = g.float()
    plain.step()
    assert all(torch.equal(m, r.detach()) for m, r in zip(optimizer.master_weights(), reference))


def test_step_runs_a_closure_with_autograd_on_as_torch_optimizers_do():
    params = _params()
    optimizer = MasterWeightAdamW(params, **KWARGS)
    before = optimizer.master_weights()

    def closure():
        optimizer.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()  # needs autograd, which the step itself runs without
        return loss

    loss = optimizer.step(closure)
    assert loss > 0 and all(not torch.equal(m, b) for m, b in zip(optimizer.master_weights(), before))
