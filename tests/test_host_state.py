"""AdamW's state in host memory (`offload_optimizer`): the same bits as on the device, every tensor of the state
in the one host buffer, checkpoints that move between the two, the staging that brings each tensor in turn,
and the refusals."""

import io
import re

import pytest
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.optim.host_state import HostState
from cohort_grpo.optim.precision import MasterWeightAdamW
from cohort_grpo.optim.optimizer import optimizer_line

SHAPES = [(64, 32), (32,), (128, 16), (7,), (40, 40)]


def _params(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device=device, dtype=torch.bfloat16))
            for shape in SHAPES]


def _run(optimizer: MasterWeightAdamW, params, steps, clip: float | None = 1.0) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        for i, p in enumerate(params):
            if (step + i) % 4 != 3:  # some tensors miss a step's gradient, as frozen-by-chance ones do
                p.grad = (torch.randn(p.shape, generator=generator) * 3).to(device=p.device, dtype=p.dtype)
        if clip is not None:
            optimizer.clip_grad_norm(clip)
        optimizer.step()
        optimizer.zero_grad()


def _state(optimizer: MasterWeightAdamW) -> list[torch.Tensor]:
    out = [optimizer.master_weight(i).cpu() for i in range(len(optimizer.masters))]
    for master in optimizer.masters:
        out += [optimizer.state[master][name].cpu().clone() for name in ("exp_avg", "exp_avg_sq")]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 4 * 700])
def test_the_state_in_host_memory_steps_to_the_same_bits_as_on_the_device(state_dtype, chunk_bytes):
    kept, moved = _params(), _params()
    on_device = MasterWeightAdamW(kept, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, seed=5,
                                  chunk_bytes=chunk_bytes)
    offloaded = MasterWeightAdamW(moved, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, seed=5,
                                  chunk_bytes=chunk_bytes, offload=True)
    _run(on_device, kept, range(6))
    _run(offloaded, moved, range(6))
    assert all(torch.equal(a, b) for a, b in zip(kept, moved))
    assert _same(_state(on_device), _state(offloaded))
    assert not torch.equal(kept[0], _params()[0])  # the step really moved the weights


def test_every_low_half_and_moment_lives_in_the_one_host_buffer():
    params = _params()
    optimizer = MasterWeightAdamW(params, lr=1e-2, state_dtype=torch.bfloat16, offload=True)
    _run(optimizer, params, range(2))
    held = {"low": list(optimizer.lows)}
    for name in ("exp_avg", "exp_avg_sq"):
        held[name] = [optimizer.state[m][name] for m in optimizer.masters]
    for name, tensors in held.items():  # each kind of state in its own buffer, which a checkpoint saves alone
        buffer = optimizer.host.buffers[name]
        start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
        assert all(start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end for t in tensors)
    held = [t for tensors in held.values() for t in tensors]
    assert len({t.data_ptr() for t in held}) == len(held)  # no two share a place
    # 2 bytes of low half and 2 + 2 of bf16 moments a parameter, each tensor's view rounded up to 256 bytes
    assert sum(p.numel() for p in params) * 6 <= optimizer.host.nbytes <= sum(p.numel() for p in params) * 6 + 3 * 256 * 5
    assert all(m.numel() == 0 for m in optimizer.masters)  # no fp32 master is kept between steps


def test_a_checkpoint_moves_between_host_and_device_state_and_continues_bit_for_bit():
    straight_params = _params()
    straight = MasterWeightAdamW(straight_params, lr=1e-2, state_dtype=torch.bfloat16, seed=7)
    _run(straight, straight_params, range(6))
    for first_offloaded in (True, False):
        first = _params()
        interrupted = MasterWeightAdamW(first, lr=1e-2, state_dtype=torch.bfloat16, seed=7, offload=first_offloaded)
        _run(interrupted, first, range(3))
        buffer = io.BytesIO()
        torch.save(interrupted.state_dict(), buffer)
        buffer.seek(0)
        resumed_params = _params(seed=99)  # the checkpoint's masters, not these values, must win
        resumed = MasterWeightAdamW(resumed_params, lr=1e-2, state_dtype=torch.bfloat16, seed=0,
                                    offload=not first_offloaded)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        if resumed.host is not None:  # loaded into the host buffer, not beside it
            assert all(resumed.state[m]["exp_avg"].data_ptr() == resumed.host.tensors[i]["exp_avg"].data_ptr()
                       for i, m in enumerate(resumed.masters))
        _run(resumed, resumed_params, range(3, 6))
        assert all(torch.equal(a, b) for a, b in zip(straight_params, resumed_params))
        assert _same(_state(straight), _state(resumed))


def test_one_by_one_hands_each_piece_its_state_and_keeps_what_the_step_wrote():
    shapes = [torch.Size(s) for s in SHAPES]
    host = HostState(shapes, {"low": torch.int16, "exp_avg": torch.bfloat16}, torch.device("cpu"))
    for i, state in enumerate(host.tensors):
        state["low"].copy_(torch.arange(shapes[i].numel()).view(shapes[i]))
    # whole tensors, and tensor 2 (2,048 elements) in slices of 700 as a large tensor is staged
    pieces = [(0, 0, 2048), (2, 0, 700), (2, 700, 1400), (2, 1400, 2048), (3, 0, 7), (4, 0, 1600)]
    seen = []
    for (i, start, stop), staged in host.one_by_one(pieces):
        assert staged["low"].shape == (stop - start,)
        assert torch.equal(staged["low"], torch.arange(start, stop, dtype=torch.int16))  # its own, no leftover
        staged["low"].add_(1)
        staged["exp_avg"].fill_(i + 0.5)
        seen.append((i, start, stop))
    assert seen == pieces
    for i, state in enumerate(host.tensors):
        numbers = torch.arange(shapes[i].numel(), dtype=torch.int16)
        stepped = i != 1
        assert torch.equal(state["low"].view(-1), numbers + 1 if stepped else numbers)
        assert torch.all(state["exp_avg"] == (i + 0.5 if stepped else 0))


def test_offload_needs_bf16_weights():
    params = [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16))]
    with pytest.raises(CohortError, match="every trained weight must be bfloat16"):
        MasterWeightAdamW(params, lr=1e-2, offload=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fused kernel and page-locked copies")
def test_on_the_gpu_the_fused_kernel_steps_host_state_to_the_same_bits_with_page_locked_copies():
    kept, moved = _params(device="cuda"), _params(device="cuda")
    on_device = MasterWeightAdamW(kept, lr=1e-2, state_dtype=torch.bfloat16, seed=3)
    offloaded = MasterWeightAdamW(moved, lr=1e-2, state_dtype=torch.bfloat16, seed=3, offload=True)
    assert on_device.fused_kernel and offloaded.fused_kernel
    assert offloaded.host.page_locked and all(b.device.type == "cpu" for b in offloaded.host.buffers.values())
    _run(on_device, kept, range(8))
    _run(offloaded, moved, range(8))
    assert all(torch.equal(a, b) for a, b in zip(kept, moved))
    assert _same(_state(on_device), _state(offloaded))


# ---- through the trainer ---------------------------------------------------------------------------------------

def _digits(completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def _trainer(model_dir, out, lines=None, **overrides):
    from cohort_grpo import GRPOConfig, GRPOTrainer
    from cohort_grpo.tasks.arithmetic import ArithmeticTask
    options = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=5, max_prompt_length=64,
                   max_steps=4, save_steps=2, learning_rate=3e-3, output_dir=str(out), quiet=True, seed=0,
                   device="cpu", dtype="bfloat16")
    options.update(overrides)
    task = ArithmeticTask()
    return GRPOTrainer(model_dir, _digits, task.load("train", size=32, seed=0), args=GRPOConfig(**options), task=task,
                       **({"log": lines.append} if lines is not None else {}))


def _losses(trainer) -> list:
    return [(r["step"], r["loss"], r["reward"]) for r in trainer.history]


def test_a_run_with_its_state_in_host_memory_trains_and_resumes_as_one_without(tiny_dir, tmp_path):
    offloaded = _trainer(tiny_dir, tmp_path / "host", offload_optimizer=True)
    assert offloaded.args.offload_optimizer is True and offloaded.optimizer.host is not None
    offloaded.train()
    assert re.fullmatch(r"optimizer: AdamW, fp32 masters, bf16 moments \(stochastic rounding\), chunked torch step, "
                        r"state in 0\.0 GiB of pageable host memory", optimizer_line(offloaded.optimizer))
    kept = _trainer(tiny_dir, tmp_path / "device")
    assert kept.args.offload_optimizer is False and kept.optimizer.host is None  # auto, on a CPU: off
    kept.train()
    assert _losses(offloaded) == _losses(kept) and len(_losses(kept)) == 4
    for a, b in zip(offloaded.model.state_dict().values(), kept.model.state_dict().values()):
        assert torch.equal(a, b)
    # the offloaded run's checkpoint resumes with the state on the device, to the same end
    lines: list[str] = []
    resumed = _trainer(tiny_dir, tmp_path / "host", lines,
                       resume_from_checkpoint=str(tmp_path / "host" / "checkpoint-2"), output_dir=str(tmp_path / "r"))
    resumed.train()
    assert any(re.search(r"resumed from .*checkpoint-2 at step 2", line) for line in lines), lines
    for a, b in zip(resumed.model.state_dict().values(), kept.model.state_dict().values()):
        assert torch.equal(a, b)


def test_offload_is_refused_where_nothing_would_be_offloaded(tiny_dir, tmp_path):
    with pytest.raises(CohortError, match=r"offload_optimizer=True .* this run trains float32 weights"):
        _trainer(tiny_dir, tmp_path / "fp32", offload_optimizer=True, dtype="auto")  # auto is float32 on a CPU


def test_offload_is_refused_on_several_processes_and_for_lora():
    from cohort_grpo import GRPOConfig
    from cohort_grpo.models import CausalLM, ModelConfig
    from cohort_grpo.parallel.placement import Placement
    from cohort_grpo.run.resolve import resolve_run_config
    model = CausalLM(ModelConfig(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=16)).to(torch.bfloat16)
    args = GRPOConfig(offload_optimizer=True, dtype="bfloat16")
    assert resolve_run_config(args, model=model, device=torch.device("cpu")).offload_optimizer is True
    with pytest.raises(CohortError, match=r"this run trains on 2 processes .*(--)?fsdp[= ](true|True)"):
        resolve_run_config(args, model=model, device=torch.device("cpu"),
                           placement=Placement.from_config(args.validate(), 2))
    with pytest.raises(CohortError, match="FSDP2 shards that state over the GPUs already"):
        GRPOConfig(offload_optimizer=True, fsdp=True).validate()
    with pytest.raises(CohortError, match="LoRA's adapters train in float32"):
        GRPOConfig(offload_optimizer=True, use_peft=True).validate()


def test_each_buffer_is_registered_whole(monkeypatch):
    """cudaHostRegister counts bytes: each buffer is registered from its first byte to its last (a count of
    elements would page-lock a half or a quarter of it, and the asynchronous copies beyond would fail)."""
    import cohort_grpo.optim.host_state as host_state

    registered = []

    class Runtime:
        def cudaHostRegister(self, pointer, size, flags):
            registered.append((pointer, size))
            return 0

        def cudaHostUnregister(self, pointer):
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    buffers = {"low": torch.zeros(1000, dtype=torch.bfloat16), "exp_avg": torch.zeros(300, dtype=torch.float32)}
    assert all(host_state.page_lock(buffer) for buffer in buffers.values())
    assert registered == [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers.values()]
