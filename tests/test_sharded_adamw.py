"""AdamW with bf16 moments on FSDP2's fp32 shards: the element-keyed noise is the GPU kernel's hash, a slice
rounds as the whole tensor's elements do, fp32 moments are torch's AdamW exactly, and two gloo ranks stepping
their shards equal one process over the whole model, through a gathered checkpoint and a resume, bit for bit."""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import cohort_grpo.optim.sharded_adamw as sharded_adamw
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.optim.bf16 import element_noise, round_with_noise
from cohort_grpo.optim.optimizer import make_optimizer, optimizer_line
from cohort_grpo.optim.sharded_adamw import ShardedAdamW

HYPER = dict(lr=3e-2, weight_decay=0.1, betas=(0.9, 0.99))


def lowbias32(key: int, index: int) -> int:
    """Wellons' mixer in plain Python integers, written from its definition (the kernel's order of operations)."""
    x = ((index * 0x9E3779B9) & 0xFFFFFFFF) ^ key
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_element_noise_is_the_hash_of_key_and_index():
    key, start = 0x5BD1E995, 2**32 - 3  # indices past 2^32 wrap as the kernel's uint32 offsets do
    noise = element_noise(key, start, 6, torch.device("cpu"))
    assert noise.tolist() == [lowbias32(key, (start + i) & 0xFFFFFFFF) for i in range(6)]


def test_a_slice_rounds_as_its_elements_do_in_the_whole_tensor_and_to_a_neighbour():
    torch.manual_seed(0)
    values = torch.randn(1000) * torch.exp(torch.randn(1000) * 3)
    values[17] = float("nan")
    whole = torch.empty(1000, dtype=torch.bfloat16)
    round_with_noise(values.clone(), whole, (element_noise(9, 0, 1000, values.device) & 0xFFFF).int(),
                     torch.empty(1000, dtype=torch.bool))
    part = torch.empty(300, dtype=torch.bfloat16)
    round_with_noise(values[400:700].clone(), part, (element_noise(9, 400, 300, values.device) & 0xFFFF).int(),
                     torch.empty(300, dtype=torch.bool))
    assert torch.equal(part.view(torch.int16), whole[400:700].view(torch.int16))
    assert torch.isnan(whole[17])
    finite = ~torch.isnan(values)
    bits = values[finite].view(torch.int32).to(torch.int64)
    down = (bits >> 16).to(torch.int32).to(torch.int16)  # toward zero, for either sign
    up = ((bits >> 16) + ((bits & 0xFFFF) != 0)).to(torch.int32).to(torch.int16)
    got = whole[finite].view(torch.int16)
    assert bool(((got == down) | (got == up)).all())
    assert 0.3 < (got != down).float().mean().item() < 0.7  # rounded up about as often as the fractions say


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 5), nn.Linear(5, 1))


def _grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in model.parameters()]


def _run(optimizer, model, steps) -> None:
    for step in steps:
        for param, grad in zip(model.parameters(), _grads(model, step)):
            param.grad = grad
        optimizer.step()


@pytest.mark.parametrize("chunk", [3, 1 << 22])
def test_fp32_moments_are_torch_adamw(monkeypatch, chunk):
    monkeypatch.setattr(sharded_adamw, "CHUNK_ELEMENTS", chunk)
    mine, theirs = _model(), _model()
    _run(ShardedAdamW(mine.parameters(), state_dtype=torch.float32, **HYPER), mine, range(3))
    _run(torch.optim.AdamW(theirs.parameters(), foreach=False, **HYPER), theirs, range(3))
    assert max((a - b).abs().max().item() for a, b in zip(mine.parameters(), theirs.parameters())) <= 1e-6


def test_bf16_moments_stay_within_a_bf16_unit_of_fp32_ones_and_any_chunking_steps_the_same_bits(monkeypatch):
    model, reference = _model(), _model()
    optimizer = ShardedAdamW(model.parameters(), **HYPER)
    fp32 = torch.optim.AdamW(reference.parameters(), foreach=False, **HYPER)
    _run(optimizer, model, range(1))
    _run(fp32, reference, range(1))
    for p, q in zip(model.parameters(), reference.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            narrow, wide = optimizer.state[p][name], fp32.state[q][name]
            assert narrow.dtype == torch.bfloat16
            assert bool(((narrow.float() - wide).abs() <= wide.abs() * 2**-7 + 1e-30).all())
    monkeypatch.setattr(sharded_adamw, "CHUNK_ELEMENTS", 4)
    chunked = _model()
    _run(ShardedAdamW(chunked.parameters(), **HYPER), chunked, range(1))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), chunked.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_steps_as_the_cpu_does():
    """The same slices on a GPU: the same noise (an integer hash), the same fp32 operations up to the GPU's
    contractions, so weights within 1e-6 and moments within a bf16 unit after 3 steps."""
    cpu, gpu = _model(), _model().cuda()
    on_cpu, on_gpu = ShardedAdamW(cpu.parameters(), seed=5, **HYPER), ShardedAdamW(gpu.parameters(), seed=5, **HYPER)
    for step in range(3):
        for p, q, grad in zip(cpu.parameters(), gpu.parameters(), _grads(cpu, step)):
            p.grad, q.grad = grad, grad.cuda()
        on_cpu.step()
        on_gpu.step()
    for p, q in zip(cpu.parameters(), gpu.parameters()):
        assert (p - q.cpu()).abs().max().item() <= 1e-6
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = on_cpu.state[p][name].float(), on_gpu.state[q][name].cpu().float()
            assert bool(((a - b).abs() <= a.abs() * 2**-7 + 1e-30).all())


def test_a_resumed_optimizer_continues_bit_for_bit():
    straight, resumed = _model(), _model()
    optimizer = ShardedAdamW(straight.parameters(), seed=7, **HYPER)
    _run(optimizer, straight, range(2))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    resumed.load_state_dict(straight.state_dict())
    again = ShardedAdamW(resumed.parameters(), seed=0, **HYPER)  # the seed comes back with the state
    again.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert again.state[next(resumed.parameters())]["exp_avg"].dtype == torch.bfloat16 and again.steps == [2] * 5
    _run(optimizer, straight, range(2, 4))
    _run(again, resumed, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))


def test_out_of_memory_before_any_change_propagates_and_after_one_stops_the_run(monkeypatch):
    model = _model()
    optimizer = ShardedAdamW(model.parameters(), **HYPER)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def noise(*args):
        calls.append(args)
        if len(calls) in (1, 3):
            raise torch.OutOfMemoryError("no memory")
        return element_noise(*args)

    monkeypatch.setattr(sharded_adamw, "element_noise", noise)
    with pytest.raises(torch.OutOfMemoryError):  # the first slice: nothing changed, the update may be retried
        _run(optimizer, model, range(1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and optimizer.steps == [0] * 5
    with pytest.raises(CohortError, match="part-way through the optimizer step"):  # the first tensor had stepped
        _run(optimizer, model, range(1))


def test_refusals_and_the_log_line():
    with pytest.raises(CohortError, match="need fp32 parameters"):
        ShardedAdamW(_model().to(torch.bfloat16).parameters())
    with pytest.raises(CohortError, match=r"optimizer_state_dtype[= ]bfloat16 needs low-precision weights"):
        make_optimizer(_model(), GRPOConfig(optimizer_state_dtype="bfloat16"))  # one process, fp32: no shards
    line = optimizer_line(ShardedAdamW(_model().parameters()))
    assert line == "optimizer: AdamW over the fp32 shards (the masters), bf16 moments (stochastic rounding), chunked torch step"


RANKS_SCRIPT = r'''
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import test_sharded_adamw as t
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.optim.optimizer import make_optimizer
from cohort_grpo.optim.sharded_adamw import ShardedAdamW
from cohort_grpo.parallel.distributed import Parallel

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2,))
args = GRPOConfig(optimizer_state_dtype="bfloat16", seed=7, learning_rate=t.HYPER["lr"],
                  weight_decay=t.HYPER["weight_decay"], adam_beta1=0.9, adam_beta2=0.99)
parallel = Parallel(rank, 2)
parallel.fsdp = True  # its optimizer_state / load_optimizer_state take the FSDP2 path


def sharded():
    model = t._model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run(model, optimizer, steps):
    for step in steps:
        for param, grad in zip(model.parameters(), t._grads(model, step)):
            param.grad = distribute_tensor(grad, mesh, [Shard(0)])  # what FSDP2's reduce-scatter leaves
        optimizer.step()


def gathered(model, optimizer):
    params = list(model.parameters())
    return {"weights": [p.full_tensor() for p in params],
            "moments": [[optimizer.state[p][n].full_tensor() for n in ("exp_avg", "exp_avg_sq")] for p in params]}


model = sharded()
optimizer = make_optimizer(model, args)
assert isinstance(optimizer, ShardedAdamW)
run(model, optimizer, range(2))
state = parallel.optimizer_state(model, optimizer)  # a collective; rank 0 holds the full dicts
if rank == 0:
    torch.save(state, out + "/checkpoint.pt")
run(model, optimizer, range(2, 4))
straight = gathered(model, optimizer)
dist.barrier()
resumed = sharded()  # a fresh run from the same initial weights, then the checkpoint's
again = make_optimizer(resumed, args)
parallel.load_optimizer_state(resumed, again, torch.load(out + "/checkpoint.pt", weights_only=True))
run(resumed, again, range(2, 4))
after = gathered(resumed, again)
if rank == 0:
    torch.save({"straight": straight, "resumed": after}, out + "/result.pt")
dist.barrier()  # no rank tears gloo down while the other still uses it (std::terminate in its threads)
dist.destroy_process_group()
'''


def test_two_gloo_ranks_equal_one_process_and_resume_exactly(tmp_path):
    """FSDP2 over 2 gloo ranks (uneven shards, and a rank with empty ones) with bf16 moments: the gathered
    weights and moments after 4 steps are one process's with the same optimizer over the whole model, bit
    for bit, and so are those of a run resumed from the gathered checkpoint after step 2."""
    (tmp_path / "ranks.py").write_text(RANKS_SCRIPT)
    tests = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "ranks.py"), str(tmp_path)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    model = _model()
    optimizer = ShardedAdamW(model.parameters(), seed=7, **HYPER)
    _run(optimizer, model, range(4))
    assert not torch.equal(next(model.parameters()), next(_model().parameters()))
    for run in ("straight", "resumed"):
        weights, moments = result[run]["weights"], result[run]["moments"]
        for i, param in enumerate(model.parameters()):
            assert torch.equal(weights[i], param.detach()), (run, i)
            for j, name in enumerate(("exp_avg", "exp_avg_sq")):
                assert moments[i][j].dtype == torch.bfloat16
                assert torch.equal(moments[i][j].view(torch.int16), optimizer.state[param][name].view(torch.int16))


@pytest.mark.slow
def test_fsdp_training_with_bf16_moments_resumes_exactly(tmp_path, tiny_dir):
    """`cohort-grpo train --fsdp --optimizer_state_dtype bfloat16` on 2 gloo ranks: the checkpoint holds the gathered
    bf16 moments of whole parameters, and a run resumed from step 1 ends with the weights of the run that did not
    stop."""
    from safetensors.torch import load_file

    (tmp_path / "rewardmod.py").write_text(REWARD_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="1")

    def train(out: Path, *extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", "--fsdp", "true",
                               "--optimizer_state_dtype", "bfloat16", "--model", tiny_dir, "--task", "arithmetic",
                               "--reward_funcs", "rewardmod:digit_share", "--num_generations", "4",
                               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                               "--max_completion_length", "8", "--max_prompt_length", "64", "--eval_limit", "0",
                               "--learning_rate", "3e-3", "--seed", "3", "--logging_steps", "1", "--device", "cpu",
                               "--save_steps", "1", "--output_dir", str(out), *extra],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-4000:]
        return done.stdout

    out = tmp_path / "run"
    train(out, "--max_steps", "2")
    saved = torch.load(out / "checkpoint-1" / "optimizer.pt", weights_only=True)["optimizer"]["fsdp_optimizer"]
    weights = load_file(out / "checkpoint-1" / "model.safetensors")
    for name, state in saved["state"].items():
        assert state["exp_avg"].dtype == torch.bfloat16 and tuple(state["exp_avg"].shape) == tuple(weights[name].shape)
    straight = load_file(out / "model.safetensors")
    shutil.rmtree(out / "checkpoint-2")
    output = train(out, "--max_steps", "2", "--resume")
    assert "resumed from" in output
    resumed = load_file(out / "model.safetensors")
    assert max((resumed[k] - straight[k]).abs().max().item() for k in straight) <= 1e-6
    assert max((straight[k] - weights[k]).abs().max().item() for k in straight) > 1e-4  # step 2 moved the weights


REWARD_MODULE = '''
def digit_share(prompts, completions, completion_ids=None, **_):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + 0.01 * len(c) for c in completions]
'''
