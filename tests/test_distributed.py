"""Several processes (issue 6): 2 ranks with gloo on the CPU against one process, the launcher, FSDP2,
resume, a rank that dies; sharding and sampling that does not depend on how a batch is split.

The process tests start real `torchrun` / `cohort-grpo train --nproc_per_node 2` jobs on the built-in tiny
model (random init) with a dense deterministic reward, so every step moves the weights."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from cohort_grpo.parallel.distributed import Parallel, average_records, shard_bounds
from cohort_grpo.rollout import Engine
from cohort_grpo.rollout.sampling import gumbel_noise
from cohort_grpo.models import from_pretrained
from cohort_grpo.rollout.sampler import SamplingParams

REWARD_MODULE = '''
def digit_share(prompts, completions, completion_ids=None, **_):
    """Share of digits plus a length bonus: dense, so every group has a spread of rewards."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + 0.01 * len(c) for c in completions]
'''
TOLERANCE = 1e-5


# ---- sharding and reductions ------------------------------------------------------------------------
@pytest.mark.parametrize("count,world", [(10, 3), (8, 2), (3, 4), (0, 2), (16, 4)])
def test_shard_bounds_split_contiguously_like_array_split(count, world):
    blocks = [list(range(count))[slice(*shard_bounds(count, r, world))] for r in range(world)]
    expected = [list(block) for block in np.array_split(np.arange(count), world)]
    assert blocks == expected
    assert sum(blocks, []) == list(range(count))


def test_shard_of_prompts_keeps_whole_groups_and_offsets_their_completions():
    """Rank r's prompts are a contiguous block, so its G completions per prompt are global rows
    [offset, offset + len(block)·G): exactly what SamplingParams.sequence_offset must say."""
    prompts, G, world = list("abcdef"), 4, 2
    rows = [p for p in prompts for _ in range(G)]  # one process: group-contiguous completions
    for rank in range(world):
        parallel = Parallel(rank=rank, world_size=world)
        block = parallel.shard(prompts)
        offset = shard_bounds(len(prompts), rank, world)[0] * G
        assert [p for p in block for _ in range(G)] == rows[offset: offset + len(block) * G]


def test_average_records_means_numbers_keeps_agreeing_ints_and_rank0_others():
    records = [{"step": 3, "loss": 1.0, "peak_memory_gib": 2.0, "mfu": None, "stage": "a", "count": 1},
               {"step": 3, "loss": 2.0, "peak_memory_gib": 5.0, "mfu": None, "stage": "b", "count": 2}]
    out = average_records(records, maximum=("peak_memory_gib",))
    assert out == {"step": 3, "loss": 1.5, "peak_memory_gib": 5.0, "mfu": None, "stage": "a", "count": 1.5}
    assert isinstance(out["step"], int)


def test_means_over_the_samples_a_rank_scored_are_weighted_by_their_counts():
    """A reward function that fails on every sample of one rank (`--reward_errors warn`): the job's mean is the
    other rank's, not NaN (null) nor halved; unequal counts weigh each rank's mean by its count, as one process
    pooling the samples would; equal counts keep the plain average."""
    scored = [2.0, 4.0, 6.0]  # rank 0 scored these; rank 1 none
    records = [{"reward": float(np.mean(scored)), "rewards/f/mean": float(np.mean(scored)), "loss": 1.0},
               {"reward": 0.0, "rewards/f/mean": float("nan"), "loss": 3.0}]
    counts = [{"reward": 3, "rewards/f/mean": 3}, {"reward": 0, "rewards/f/mean": 0}]
    out = average_records(records, counts=counts)
    assert out == {"reward": 4.0, "rewards/f/mean": 4.0, "loss": 2.0}
    pooled = [1.0, 2.0, 3.0, 10.0]  # rank 0 scored 3 samples, rank 1 one
    records = [{"reward": float(np.mean(pooled[:3]))}, {"reward": pooled[3]}]
    out = average_records(records, counts=[{"reward": 3}, {"reward": 1}])
    assert out["reward"] == pytest.approx(float(np.mean(pooled)), abs=1e-12)
    nothing = [{"reward": 0.0}, {"reward": 0.0}]  # no rank scored any: as one process says it (0)
    assert average_records(nothing, counts=[{"reward": 0}, {"reward": 0}]) == {"reward": 0.0}
    same = [{"reward": 0.1}, {"reward": 0.7}]
    assert average_records(same, counts=[{"reward": 4}, {"reward": 4}]) == average_records(same)


def test_one_process_parallel_is_a_no_op():
    parallel = Parallel()
    module = torch.nn.Linear(2, 2)
    assert parallel.wrap(module) is module and parallel.wrap(module, fsdp=True) is module
    assert parallel.all_reduce_sum(2.5) == 2.5 and parallel.shard([1, 2, 3]) == [1, 2, 3]
    record = {"loss": 0.5}
    assert parallel.mean_metrics(record) is record and parallel.is_main
    with parallel.no_sync(module, last=False):
        pass


@pytest.mark.parametrize("argv,expected", [
    (["--nproc_per_node", "two"], "--nproc_per_node 'two': give the number of processes, e.g. --nproc_per_node 2"),
    (["--nproc_per_node", "0"], "--nproc_per_node '0': give the number of processes, e.g. --nproc_per_node 2"),
])
def test_launcher_bad_process_counts_are_one_line(argv, expected, tiny_dir, capsys, tmp_path):
    from cohort_grpo.cli import main

    assert main(["train", *argv, "--model", tiny_dir, "--output_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"cohort: error: {expected}"


def test_launcher_refuses_to_nest_under_torchrun(tiny_dir, capsys, tmp_path, monkeypatch):
    from cohort_grpo.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--nproc_per_node", "2", "--model", tiny_dir, "--output_dir", str(tmp_path)]) == 2
    assert "already runs under torchrun" in capsys.readouterr().err


@pytest.mark.parametrize("processes, gpus, expected", [
    ("2", 0, "device 'cuda' asked for, but no CUDA GPU is available; use --device cpu"),
    ("4", 2, "this node runs 4+ processes but has 2 GPU(s); pass --nproc_per_node at most the number of GPUs"),
])
def test_launcher_refuses_more_processes_than_gpus_before_torchrun_starts(processes, gpus, expected, tiny_dir, capsys,
                                                                         tmp_path, monkeypatch):
    """Each rank would refuse it once started (exit 1, with a --resume hint that does not apply): the launcher
    does, in one line, exit 2, no torchrun started."""
    import subprocess as subprocesses

    from cohort_grpo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    started = []
    monkeypatch.setattr(subprocesses, "Popen", lambda *a, **k: started.append(a))
    assert main(["train", "--nproc_per_node", processes, "--device", "cuda", "--model", tiny_dir,
                 "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"cohort: error: {expected}"
    assert started == [] and not (tmp_path / "out").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_torchrun_in_its_own_session_dies_with_a_launcher_killed_outright(tmp_path):
    """The launcher starts torchrun in a session of its own (signals reach it once, through the launcher); a launcher
    killed by SIGKILL forwards nothing, so its child is asked by the kernel to stop (SIGTERM) instead of running on."""
    parent = tmp_path / "parent.py"
    parent.write_text(
        "import os, signal, subprocess, sys\n"
        "from cohort_grpo.cli.launch import stop_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True,\n"
        "                         preexec_fn=stop_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr
    child = int(done.stdout.split()[0])

    def alive() -> bool:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        return state != "Z"  # a zombie has ended; whoever adopted it reaps it

    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()


def test_the_launcher_starts_torchrun_in_its_own_session_bound_to_its_life(tiny_dir, tmp_path, monkeypatch):
    from cohort_grpo.cli import main
    from cohort_grpo.cli.launch import stop_with_parent

    class Started(Exception):
        pass

    asked = {}

    def popen(command, **options):
        asked.update(options)
        raise Started

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Started):
        main(["train", "--nproc_per_node", "2", "--device", "cpu", "--model", tiny_dir,
              "--output_dir", str(tmp_path / "out")])
    assert asked["start_new_session"] is True and asked["preexec_fn"] is stop_with_parent


# ---- sampling independent of the batch split ----------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    torch.manual_seed(3)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                                      initializer_range=0.2, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("qwen_split")
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    return from_pretrained(folder)


PROMPTS = [[(5 * i + j) % 300 for j in range(2 + i % 4)] for i in range(6)]


def sampled(max_new_tokens=10, **kwargs):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_k=50, seed=1234, **kwargs)


def test_gumbel_noise_takes_one_token_index_per_row():
    rows, draws = torch.tensor([4, 9, 4]), torch.tensor([0, 2, 7])
    noise = gumbel_noise(torch.tensor(11), draws, rows, 50)
    for i in range(3):
        assert torch.equal(noise[i], gumbel_noise(torch.tensor(11), draws[i], rows[i:i + 1], 50)[0])
    assert not torch.equal(noise[0], noise[2])  # same sequence, another token: other noise


def test_sampled_tokens_do_not_depend_on_max_batch_size(qwen):
    """Temperature 1 with EOS, so sequences finish at different steps and slots are reused and
    compacted differently: the tokens must still be the same (noise keyed by sequence and token)."""
    first = Engine(qwen, max_batch_size=64).generate(PROMPTS, 3, sampled(eos_token_ids=[7, 8, 9, 10, 11]))
    eos = sorted({int(t) for t in first.completion_ids[:, 2]})[:4]  # tokens some sequences do sample early
    params = sampled(eos_token_ids=eos)
    wide = Engine(qwen, max_batch_size=64).generate(PROMPTS, 3, params)
    for max_batch_size, check_interval in [(1, 1), (4, 3), (7, 2)]:
        narrow = Engine(qwen, max_batch_size=max_batch_size, check_interval=check_interval).generate(PROMPTS, 3, params)
        assert torch.equal(narrow.completion_ids, wide.completion_ids), max_batch_size
        assert torch.equal(narrow.completion_mask, wide.completion_mask)
        assert torch.allclose(narrow.logprobs, wide.logprobs, atol=1e-5)
    assert len(set(wide.completion_mask.sum(1).tolist())) > 1, "EOS should end some completions early"
    assert len({tuple(r) for r in wide.completion_ids.tolist()}) == len(wide.finish_reasons), "completions differ"


def test_a_batch_split_over_ranks_samples_what_one_process_samples(qwen):
    G = 3
    whole = Engine(qwen, max_batch_size=8).generate(PROMPTS, G, sampled())
    parts = []
    for rank in range(2):
        start, stop = shard_bounds(len(PROMPTS), rank, 2)
        parts.append(Engine(qwen, max_batch_size=5).generate(PROMPTS[start:stop], G,
                                                             sampled(sequence_offset=start * G)))
    width = max(p.completion_ids.shape[1] for p in parts)
    assert torch.equal(torch.cat([p.completion_ids[:, :width] for p in parts]), whole.completion_ids[:, :width])
    unshifted = Engine(qwen, max_batch_size=5).generate(PROMPTS[3:], G, sampled())  # offset forgotten
    assert not torch.equal(unshifted.completion_ids, parts[1].completion_ids)


# ---- real processes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    (root / "rewardmod.py").write_text(REWARD_MODULE)
    return root


def environment(root: Path, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="1", **extra)


def train_options(model: str, out: Path, accumulation: int, *extra: str) -> list[str]:
    """4 prompts × G = 4 per step in all: one process accumulates 4 micro-batches of 4, each of 2 ranks 2.
    β > 0 and μ = 2 so the loss has its KL and clipped-ratio parts. A small learning rate: AdamW's first
    updates are ≈ lr·sign(g), so gradient elements near 0, where the order of the floating-point sums
    over ranks decides the last bits, move their weight by up to ~lr·1e-2 differently (measured)."""
    return ["--model", model, "--task", "arithmetic", "--reward_funcs", "rewardmod:digit_share",
            "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", str(accumulation), "--max_completion_length", "8",
            "--max_prompt_length", "64", "--eval_limit", "5", "--learning_rate", "3e-4", "--beta", "0.04",
            "--num_iterations", "2", "--seed", "3", "--logging_steps", "1", "--device", "cpu", "--quiet", "--output_dir", str(out), *extra]


def run(root: Path, command: list[str], timeout: int = 240) -> str:
    done = subprocess.run(command, env=environment(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "cohort_grpo",
            "train", *args]


def step_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def assert_same_training(out: Path, reference: Path, weights_of: Path | None = None) -> None:
    """Same loss at every step and the same final weights (≤ 1e-5), and the weights did move."""
    got, expected = step_records(out), step_records(reference)
    assert [r["step"] for r in got] == [r["step"] for r in expected[:len(got)]]
    for mine, theirs in zip(got, expected):
        assert abs(mine["loss"] - theirs["loss"]) <= TOLERANCE, (mine["step"], mine["loss"], theirs["loss"])
        assert abs(mine["reward"] - theirs["reward"]) <= TOLERANCE  # the same completions were sampled
        assert abs(mine["grad_norm"] - theirs["grad_norm"]) <= 1e-4 * max(1.0, theirs["grad_norm"])
    weights, expected_weights = load_file(out / "model.safetensors"), load_file((weights_of or reference) / "model.safetensors")
    assert weights.keys() == expected_weights.keys()
    worst = max((weights[k] - expected_weights[k]).abs().max().item() for k in weights)
    assert worst <= TOLERANCE, worst


@pytest.fixture(scope="module")
def one_process(setup, tiny_dir):
    """The reference: one process, 3 steps, a checkpoint after each (a 2-step run is its checkpoint-2:
    the learning rate is constant)."""
    out = setup / "one"
    run(setup, [sys.executable, "-m", "cohort_grpo", "train",
                *train_options(tiny_dir, out, 4, "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "0")])
    initial = load_file(Path(tiny_dir) / "model.safetensors")
    final = load_file(out / "model.safetensors")
    assert max((final[k] - initial[k]).abs().max().item() for k in final) > 100 * TOLERANCE, "training must move the weights"
    assert all(abs(r["loss"]) > 100 * TOLERANCE for r in step_records(out)[1:]), "a loss too small to compare"
    return out


@pytest.mark.slow
def test_two_ranks_via_the_launcher_equal_one_process_and_resume(setup, tiny_dir, one_process):
    """`cohort-grpo train --nproc_per_node 2` (DDP, gloo) for 2 steps, then `--resume` to step 3 on 2 ranks:
    the loss of every step and the weights equal one process's (≤ 1e-5)."""
    out = setup / "ddp"
    output = run(setup, [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2",
                         *train_options(tiny_dir, out, 2, "--max_steps", "2")])
    assert output.count("Step 2/2") == 1, "rank 0 alone prints"
    assert "eval (step 2): accuracy=" in output and "on 5 problems" in output  # 3 + 2 rows, counts summed
    assert [r["step"] for r in step_records(out)] == [1, 2]  # one line per step: rank 0 alone logs
    assert_same_training(out, one_process, weights_of=one_process / "checkpoint-2")
    assert (out / "checkpoint-2" / "config.json").is_file()  # an ordinary HF folder
    output = run(setup, torchrun(*train_options(tiny_dir, out, 2, "--max_steps", "3", "--resume")))
    assert "resumed from" in output and output.count("Step 3/3") == 1
    assert_same_training(out, one_process)


@pytest.mark.slow
def test_fsdp2_on_two_ranks_equals_one_process(setup, tiny_dir, one_process):
    """`torchrun -m cohort_grpo train --fsdp` (FSDP2 fully_shard over gloo; fp32 on the CPU): the sharded
    update and the full copy the engine samples from give one process's run. With `--free_sampling_memory`
    the copy's memory is freed from each rollout to its refresh (π_old's pass, μ = 2, goes through FSDP2)."""
    out = setup / "fsdp"
    output = run(setup, torchrun(*train_options(tiny_dir, out, 2, "--max_steps", "2", "--fsdp", "--save_steps", "1",
                                                 "--free_sampling_memory", "true")))
    assert output.count("Step 2/2") == 1
    assert_same_training(out, one_process, weights_of=one_process / "checkpoint-2")
    optimizer = torch.load(out / "checkpoint-2" / "optimizer.pt", weights_only=True)["optimizer"]
    assert "fsdp_optimizer" in optimizer  # the full optimizer state, gathered from both shards
    moments = [v["exp_avg"] for v in optimizer["fsdp_optimizer"]["state"].values()]
    assert moments and all(not hasattr(m, "device_mesh") for m in moments)  # plain tensors, not shards


@pytest.mark.slow
def test_fsdp2_ranks_sampling_as_one_tensor_parallel_group_equal_one_process_and_resume(setup, tiny_dir, one_process):
    """`--fsdp --rollout_tensor_parallel_size 2` on 2 ranks (the colocated placement): each rank keeps half of
    the model for the engine, refreshed from the FSDP2 weights after each update, and both sample their prompts
    in one call; π_ref is an FSDP2-sharded copy (β > 0), π_old runs through the FSDP2 policy (μ = 2). Losses and
    weights are one process's (and so `--fsdp` with T = 1's, test above), through a checkpoint and --resume."""
    out = setup / "colocated"
    options = ("--fsdp", "--rollout_tensor_parallel_size", "2", "--save_steps", "1")
    output = run(setup, [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2",
                         *train_options(tiny_dir, out, 2, "--max_steps", "2", *options)])
    assert ("rollouts: sampled on the 2 training ranks in 1 tensor-parallel group(s) of 2, each rank keeping its "
            "shard (rollout_tensor_parallel_size; colocated with FSDP2") in output
    assert "eval (step 2): accuracy=" in output and "on 5 problems" in output  # the group's rows counted once
    assert_same_training(out, one_process, weights_of=one_process / "checkpoint-2")
    for name in ("model.safetensors", "reference.safetensors"):  # gathered from the FSDP2 shards on rank 0
        saved, expected = load_file(out / "checkpoint-1" / name), load_file(one_process / "checkpoint-1" / name)
        assert saved.keys() == expected.keys()
        assert max((saved[k] - expected[k]).abs().max().item() for k in saved) <= TOLERANCE
    shutil.rmtree(out / "checkpoint-2")  # resume from the first checkpoint: two steps after it
    output = run(setup, torchrun(*train_options(tiny_dir, out, 2, "--max_steps", "3", "--resume", *options)))
    assert "resumed from" in output and "checkpoint-1 at step 1" in output and output.count("Step 3/3") == 1
    assert_same_training(out, one_process)


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_job_with_a_message(setup, tiny_dir):
    out = setup / "killed"
    tag = f"cohort-dead-rank-{os.getpid()}"
    command = [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2",
               *train_options(tiny_dir, out, 1, "--max_steps", "1000", "--eval_limit", "0", "--ddp_timeout", "60")]
    process = subprocess.Popen(command, env=environment(setup, COHORT_TEST_TAG=tag), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while not (out / "metrics.jsonl").is_file() or not step_records(out):  # both ranks finished step 1
            assert process.poll() is None and time.monotonic() < deadline, "the job did not reach step 1"
            time.sleep(0.2)
        victim = rank_one_pid(tag)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert elapsed < 120, elapsed
    assert [line for line in output.splitlines() if line.startswith("cohort: error:")] == [
        "cohort: error: rank 1 (trainer) was killed by SIGKILL; the job stopped before it saved a checkpoint"], \
        output[-3000:]  # save_steps 0: no checkpoint before the last step, so no --resume
    assert len(step_records(out)) < 1000


FAILING_ON_RANK_ONE = '''
import os

def half_on_rank_zero(prompts, completions, **_):
    if os.environ["RANK"] == "1":
        raise ValueError("unreachable from rank 1")
    return [0.5] * len(completions)
'''


def test_a_reward_function_failing_on_one_rank_only_logs_the_other_rank_s_mean(setup, tiny_dir):
    """`--reward_errors warn` and a function that raises on rank 1 alone: the job finishes, and the logged means
    are over the samples rank 0 scored (all 0.5), as one process pooling them would say, not null nor halved."""
    (setup / "failing_reward.py").write_text(FAILING_ON_RANK_ONE)
    out = setup / "one-rank-fails"
    options = train_options(tiny_dir, out, 1, "--max_steps", "1", "--eval_limit", "0", "--reward_errors", "warn")
    options[options.index("rewardmod:digit_share")] = "failing_reward:half_on_rank_zero"
    output = run(setup, [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", *options], timeout=120)
    assert "unreachable from rank 1" in output
    record, = step_records(out)
    assert record["rewards/half_on_rank_zero/mean"] == 0.5 and record["reward"] == 0.5, record
    assert record["rewards/half_on_rank_zero/std"] == 0.0 and record["rewards/unscored_frac"] == 0.5


@pytest.mark.slow
def test_sigint_to_the_launcher_alone_stops_the_job_with_a_checkpoint_and_resume_goes_on(setup, tiny_dir):
    """`kill -INT <cohort-grpo's pid>` (a supervisor or `timeout -s INT`, not a terminal's whole process group):
    the ranks finish their step and save, the launcher exits 130 in one line naming --resume, and --resume
    continues from that checkpoint to the end."""
    out = setup / "interrupted"
    options = train_options(tiny_dir, out, 1, "--max_steps", "40", "--eval_limit", "0")
    process = subprocess.Popen([sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", *options],
                               env=environment(setup), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # the signal reaches the launcher alone
    try:
        deadline = time.monotonic() + 60
        while not (out / "metrics.jsonl").is_file() or not step_records(out):
            assert process.poll() is None and time.monotonic() < deadline, "the job did not reach step 1"
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, output[-3000:]
    assert "cohort: the 2 training processes stopped on SIGINT; continue from the newest checkpoint with --resume" \
        in output, output[-3000:]
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert saved and saved[-1] < 40, saved
    run(setup, [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "2", *options, "--resume", "true"],
        timeout=120)
    steps = [r["step"] for r in step_records(out)]
    assert steps == list(range(1, 41)), steps  # the interrupted run's steps, then the resumed ones after them


def rank_one_pid(tag: str) -> int:
    """The pid of the rank-1 worker of the job whose environment holds COHORT_TEST_TAG=tag."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = (Path("/proc") / entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"COHORT_TEST_TAG={tag}".encode() in env and b"RANK=1" in env and b"LOCAL_RANK=1" in env:
            return int(entry)
    raise AssertionError("no rank-1 process found")
