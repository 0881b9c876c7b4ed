"""Several machines: `cohort-grpo train --nproc_per_node N --nnodes M --node_rank R --master_addr HOST ...`
launches torchrun's static rendezvous on each machine; its option errors, the device each rank takes
(LOCAL_RANK, not RANK), and two "nodes" on one host over gloo against one process, each in its own
folder as on machines that share no disk: node 1 writes nothing, and `--resume` needs node 0's
checkpoint on every node.

The process tests reuse tests/test_distributed.py's set-up (imported from it): the built-in tiny model
(random init), the arithmetic task with a dense reward, the same options and tolerance."""

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cohort_grpo.cli import main
from cohort_grpo.cli.launch import torchrun_arguments
from cohort_grpo.cli.train import unreachable_checkpoint
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.errors import CohortError
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.parallel.faults import REPORT_ENV
from cohort_grpo.run.checkpoint import MARKER, TRAINER_STATE
from test_distributed import REWARD_MODULE, assert_same_training, environment, step_records, train_options

NODE = ["--nnodes", "2", "--master_addr", "10.0.0.1"]


# ---- the options ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,expected", [
    (["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"],
     "--nnodes / --node_rank / --master_addr without --nproc_per_node: add --nproc_per_node N, the number of "
     "processes torchrun starts on this machine (e.g. its GPUs; 1 for one process per machine)"),
    (["--node_rank", "0"],
     "--node_rank without --nproc_per_node: add --nproc_per_node N, the number of processes torchrun starts on "
     "this machine (e.g. its GPUs; 1 for one process per machine)"),
    (["--nproc_per_node", "2", "--nnodes", "two", "--node_rank", "0"],
     "--nnodes 'two': give the number of machines, e.g. --nnodes 2 (the same on every machine)"),
    (["--nproc_per_node", "2", "--nnodes", "0"],
     "--nnodes '0': give the number of machines, e.g. --nnodes 2 (the same on every machine)"),
    (["--nproc_per_node", "2", *NODE],
     "--nnodes 2 needs --node_rank: this machine's index, 0 on the machine at --master_addr and 1 on the others"),
    (["--nproc_per_node", "2", *NODE, "--node_rank", "2"],
     "--node_rank '2' is outside [0, 2): give this machine's index among the --nnodes 2 machines, 0 on the "
     "machine at --master_addr and 1 on the others"),
    (["--nproc_per_node", "2", "--nnodes", "3", "--master_addr", "h", "--node_rank=-1"],
     "--node_rank '-1' is outside [0, 3): give this machine's index among the --nnodes 3 machines, 0 on the "
     "machine at --master_addr and 1 to 2 on the others"),
    (["--nproc_per_node", "2", "--node_rank", "1"],
     "--node_rank '1' needs --nnodes M, the number of machines (without it there is one machine, node 0)"),
    (["--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1"],
     "--nnodes 2 needs --master_addr: the address of the machine with --node_rank 0, reachable from every "
     "machine (e.g. --master_addr 10.0.0.1), the same on all of them"),
    (["--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr="],
     "--master_addr '': give the host name or IP address of the machine with --node_rank 0, e.g. "
     "--master_addr 10.0.0.1"),
    (["--nproc_per_node", "2", *NODE, "--node_rank", "1", "--master_port", "http"],
     "--master_port 'http': give a TCP port number from 1 to 65535, free on the machine at --master_addr and the "
     "same on every machine (default 29500)"),
    (["--nproc_per_node", "2", *NODE, "--node_rank", "1", "--master-port", "65536"],
     "--master_port '65536': give a TCP port number from 1 to 65535, free on the machine at --master_addr and the "
     "same on every machine (default 29500)"),
    (["--nproc_per_node", "0", *NODE, "--node_rank", "1"],
     "--nproc_per_node '0': give the number of processes, e.g. --nproc_per_node 2"),
])
def test_bad_node_options_are_one_line(argv, expected, tiny_dir, capsys, tmp_path):
    assert main(["train", *argv, "--model", tiny_dir, "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"cohort: error: {expected}"
    assert not (tmp_path / "out").exists()


def test_torchrun_arguments_use_the_static_rendezvous_on_several_machines():
    nodes = {"nnodes": "2", "node_rank": "1", "master_addr": "node0.cluster", "master_port": "29511"}
    assert torchrun_arguments("4", nodes) == ["--nnodes=2", "--node_rank=1", "--master_addr=node0.cluster",
                                              "--master_port=29511", "--nproc_per_node=4"]
    assert torchrun_arguments("4", {k: v for k, v in nodes.items() if k != "master_port"}) == [
        "--nnodes=2", "--node_rank=1", "--master_addr=node0.cluster", "--nproc_per_node=4"]  # torchrun's 29500
    assert torchrun_arguments("4", {}) == ["--standalone", "--nproc_per_node=4"]  # one machine, as before
    assert torchrun_arguments("2", {"nnodes": "1", "node_rank": "0"}) == ["--standalone", "--nproc_per_node=2"]


class FakeTorchrun:
    """subprocess.Popen for `launch_job`: records the command, exits with `code`."""

    commands: list = []
    code = 0

    def __init__(self, command, **_):
        FakeTorchrun.commands.append(command)

    def wait(self):
        return FakeTorchrun.code

    def send_signal(self, signum):
        pass


@pytest.mark.parametrize("code", [0, 1])
def test_the_launcher_starts_this_machines_torchrun(code, tiny_dir, capsys, tmp_path, monkeypatch):
    FakeTorchrun.commands, FakeTorchrun.code = [], code
    monkeypatch.setattr(subprocess, "Popen", FakeTorchrun)
    out = str(tmp_path / "out")
    assert main(["train", "--nproc_per_node", "4", "--nnodes", "2", "--node-rank=1", "--master_addr", "10.0.0.1",
                 "--master_port", "29511", "--model", tiny_dir, "--output_dir", out, "--max_steps", "3"]) == code
    [command] = FakeTorchrun.commands
    assert command[:3] == [sys.executable, "-m", "cohort_grpo.parallel.faults"]  # torchrun, its failures kept for one line
    assert command[4:] == ["--nnodes=2", "--node_rank=1",
                       "--master_addr=10.0.0.1", "--master_port=29511", "--nproc_per_node=4", "-m", "cohort_grpo", "train",
                       "--model", tiny_dir, "--output_dir", out, "--max_steps", "3"]  # no node option reaches a rank
    err = capsys.readouterr().err
    if code:
        assert err.strip() == ("cohort: error: the 4 training process(es) of node 1 (of 2 machines) stopped with exit "
                               "code 1 (the log above shows why; a rank that lost a collective points to another "
                               "machine's line)")
    assert not (tmp_path / "out").exists()  # the launcher itself writes nothing


def complete_checkpoint(out: Path, step: int) -> Path:
    """A checkpoint folder that `check_checkpoint` (without hashes) reads as complete."""
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    state = json.dumps({"step": step, "config": {"max_steps": step}})
    (folder / TRAINER_STATE).write_text(state)
    (folder / MARKER).write_text(json.dumps({"files": {TRAINER_STATE: {"bytes": len(state), "sha256": ""}}}))
    return folder


class FailingTorchrun(FakeTorchrun):
    """A job whose rank 1 fails with a line, after writing the checkpoints `saves` names into `out`."""

    out: Path = Path()
    saves: tuple = ()

    def __init__(self, command, env, **_):
        super().__init__(command)
        for step in FailingTorchrun.saves:
            complete_checkpoint(FailingTorchrun.out, step)
        record = {"time": 1.0, "line": "rank 1 reward function broke: ValueError: no"}
        (Path(env[REPORT_ENV]) / "rank-1.json").write_text(json.dumps(record))


@pytest.mark.parametrize("before,saves,resume,node,ending", [
    ((), (), False, None, "; the job stopped before it saved a checkpoint"),
    ((), (2,), False, None, "; the job stopped — continue from the newest checkpoint with --resume"),
    ((4,), (), False, None, "; the job stopped before it saved a checkpoint"),  # a finished run it did not replace
    ((4,), (), True, None, "; the job stopped — continue from the newest checkpoint with --resume"),
    ((), (), False, "1", " on node 1; the job stopped — node 0's line says whether a checkpoint to continue from was "
                         "saved"),
])
def test_a_failed_job_names_resume_only_when_it_left_a_checkpoint(before, saves, resume, node, ending, tiny_dir,
                                                                  capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    for step in before:
        complete_checkpoint(out, step)
    FakeTorchrun.commands, FakeTorchrun.code = [], 1
    FailingTorchrun.out, FailingTorchrun.saves = out, saves
    monkeypatch.setattr(subprocess, "Popen", FailingTorchrun)
    nodes = [*NODE, "--node_rank", node] if node else []
    assert main(["train", "--nproc_per_node", "2", *nodes, "--model", tiny_dir, "--output_dir", str(out),
                 *["--resume"] * resume]) == 1
    assert capsys.readouterr().err.strip() == f"cohort: error: rank 1 (trainer) reward function broke: ValueError: no{ending}"


@pytest.mark.parametrize("saves,ending", [((), " before it saved a checkpoint"),
                                          ((1,), "; continue from the newest checkpoint with --resume")])
def test_a_job_stopped_by_a_signal_names_resume_only_when_it_saved(saves, ending, tiny_dir, capsys, tmp_path,
                                                                  monkeypatch):
    out = tmp_path / "out"

    class InterruptedTorchrun(FakeTorchrun):
        def wait(self):  # SIGINT reaches the launcher while torchrun runs; the ranks save `saves`, then stop
            signal.raise_signal(signal.SIGINT)
            for step in saves:
                complete_checkpoint(out, step)
            return 1

    FakeTorchrun.commands = []
    monkeypatch.setattr(subprocess, "Popen", InterruptedTorchrun)
    assert main(["train", "--nproc_per_node", "2", "--model", tiny_dir, "--output_dir", str(out)]) == 130
    assert capsys.readouterr().err.strip() == f"cohort: the 2 training processes stopped on SIGINT{ending}"


def test_help_accepts_the_node_options(capsys):
    assert main(["train", "--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr", "h",
                 "--master_port", "29500", "--help"]) == 0
    text = capsys.readouterr().out
    assert all(option in text for option in ("--nnodes M", "--node_rank R", "--master_addr HOST", "--master_port P"))


# ---- the ranks: RANK is global, LOCAL_RANK picks the GPU ------------------------------------------------
@pytest.fixture
def two_gpus_with_a_group(monkeypatch):
    """A machine that seems to have 2 GPUs, in a process group already made (nothing is initialised)."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_second_machines_ranks_take_gpus_by_local_rank(two_gpus_with_a_group):
    two_gpus_with_a_group.setenv("WORLD_SIZE", "4")
    for rank, local_rank in [(0, 0), (1, 1), (2, 0), (3, 1)]:  # 2 machines × 2 GPUs
        two_gpus_with_a_group.setenv("RANK", str(rank))
        two_gpus_with_a_group.setenv("LOCAL_RANK", str(local_rank))
        parallel = Parallel.from_env("cuda", 60)
        assert parallel.device == torch.device("cuda", local_rank)
        assert (parallel.rank, parallel.local_rank, parallel.world_size) == (rank, local_rank, 4)
        assert parallel.is_main == (rank == 0)  # node 1's local rank 0 neither logs nor saves
        assert not parallel.owns_group


def test_a_launcher_without_local_rank_is_refused_on_a_machine_with_several_gpus(two_gpus_with_a_group):
    two_gpus_with_a_group.setenv("WORLD_SIZE", "4")
    two_gpus_with_a_group.setenv("RANK", "3")
    with pytest.raises(CohortError, match=r"rank 3: LOCAL_RANK is not set, and it picks this process's GPU"):
        Parallel.from_env("cuda", 60)


def test_a_launcher_without_master_address_is_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(CohortError, match="^WORLD_SIZE=2 but MASTER_ADDR not set: start the ranks with torchrun"):
        Parallel.from_env("cpu", 60)


def test_a_checkpoint_that_this_machine_cannot_reach_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    missing = FileNotFoundError(2, "No such file or directory", "/runs/x/checkpoint-20/trainer_state.json")
    error = unreachable_checkpoint(missing, GRPOConfig(resume=True))
    assert isinstance(error, CohortError) and str(error) == (
        "rank 2 cannot read /runs/x/checkpoint-20/trainer_state.json: rank 0 resumes from that checkpoint, and every "
        "machine must reach it at the same path; put output_dir on a filesystem all machines share, or copy the "
        "checkpoint folder to that path on each machine")
    assert unreachable_checkpoint(missing, GRPOConfig()) is missing  # not resuming: another problem
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert unreachable_checkpoint(missing, GRPOConfig(resume=True)) is missing


# ---- two "machines" on this host -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def nodes(root: Path, options: list[str], succeed: bool = True, timeout: int = 240) -> list[str]:
    """`launch_nodes` on a free port; again on another one if the port was taken between the probe and
    torchrun's bind (another process on this shared machine may take it: not the code under test)."""
    for attempt in range(3):
        outputs, codes = launch_nodes(root, options, str(free_port()), timeout)
        if not any("address already in use" in out.lower() for out in outputs) or attempt == 2:
            break
    for node, (code, output) in enumerate(zip(codes, outputs)):
        assert (code == 0) == succeed, f"node {node}: exit code {code}\n{output[-4000:]}"
    return outputs


def launch_nodes(root: Path, options: list[str], port: str, timeout: int) -> tuple[list[str], list[int]]:
    """`cohort-grpo train --nproc_per_node 1 --nnodes 2 --node_rank R --master_addr 127.0.0.1 --master_port P ...options`
    for R = 0 and 1, started together, each in its own folder root/machineR as on machines that share no disk
    (a relative --output_dir is a different folder on each). Their outputs and exit codes, node 0 first."""
    processes = []
    for node in (0, 1):
        (root / f"machine{node}").mkdir(exist_ok=True)
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "cohort_grpo", "train", "--nproc_per_node", "1", "--nnodes", "2",
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port, *options],
            cwd=root / f"machine{node}", env=environment(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=timeout)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return outputs, [process.returncode for process in processes]


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_node")
    (root / "rewardmod.py").write_text(REWARD_MODULE)
    return root


@pytest.fixture(scope="module")
def one_process(setup, tiny_dir):
    """The reference: one process, 3 steps, a checkpoint after each (checkpoint-2 is a 2-step run's end)."""
    out = setup / "one"
    done = subprocess.run([sys.executable, "-m", "cohort_grpo", "train", *train_options(
        tiny_dir, out, 4, "--max_steps", "3", "--save_steps", "1", "--save_total_limit", "0")],
        env=environment(setup), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:]
    return out


@pytest.fixture(scope="module")
def two_nodes(setup, tiny_dir):
    """Two machines of one process each (gloo over 127.0.0.1), 2 steps, --output_dir run on each."""
    outputs = nodes(setup, train_options(tiny_dir, Path("run"), 2, "--max_steps", "2"))
    return setup / "machine0" / "run", setup / "machine1" / "run", outputs


@pytest.mark.slow
def test_two_nodes_equal_one_process_and_only_node_0_writes(two_nodes, one_process):
    """The losses and the final weights equal one process's (≤ 1e-5); node 0 alone prints and writes,
    node 1's output folder holds no file."""
    out0, out1, (node0, node1) = two_nodes
    assert node0.count("Step 2/2") == 1 and "Step" not in node1, node1[-2000:]
    assert [r["step"] for r in step_records(out0)] == [1, 2]  # one line per step: global rank 0 alone logs
    assert_same_training(out0, one_process, weights_of=one_process / "checkpoint-2")
    assert (out0 / "checkpoint-2" / "trainer_state.json").is_file() and (out0 / "summary.json").is_file()
    assert files_in(out1) == []


@pytest.mark.slow
def test_resume_needs_the_checkpoint_on_every_node(setup, two_nodes, one_process, tiny_dir):
    """--resume to step 3: node 1, which cannot read node 0's checkpoint, says so in one line and both
    nodes stop; with the checkpoint folder copied to node 1's output folder the run continues to one
    process's step 3."""
    out0, out1, _ = two_nodes
    resume = train_options(tiny_dir, Path("run"), 2, "--max_steps", "3", "--resume", "--ddp_timeout", "60")
    node0, node1 = nodes(setup, resume, succeed=False)
    assert ("cohort: error: rank 1 (trainer) cannot read run/checkpoint-2/trainer_state.json: rank 0 resumes from that "
            "checkpoint, and every machine must reach it at the same path") in node1, node1[-3000:]
    assert "on node 1; the job stopped — node 0's line says whether a checkpoint to continue from was saved" in node1
    assert "on node 0; the job stopped — continue from the newest checkpoint with --resume" in node0 or \
        "of node 0 (of 2 machines) stopped" in node0, node0[-3000:]
    assert re.search(r"cohort: error: .* on node 0; the job stopped|of node 0 \(of 2 machines\) stopped", node0), node0[-3000:]
    assert files_in(out1) == [] and not (out0 / "checkpoint-3").exists()
    shutil.copytree(out0 / "checkpoint-2", out1 / "checkpoint-2")
    node0, node1 = nodes(setup, resume)
    assert "resumed from" in node0 and node0.count("Step 3/3") == 1 and "Step" not in node1
    assert_same_training(out0, one_process)
    assert {name.split("/")[0] for name in files_in(out1)} == {"checkpoint-2"}  # node 1 wrote nothing new


FSDP_SCRIPT = '''
import torch
from torch import nn
from cohort_grpo.parallel.distributed import Parallel
from cohort_grpo.parallel.faults import REPORT_ENV
from cohort_grpo.run.checkpoint import MARKER, TRAINER_STATE

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

parallel = Parallel.from_env("cpu", 60)
torch.manual_seed(parallel.rank)  # each "machine" built its own, different copy
model = nn.Sequential(Block(), Block())
sharded = parallel.wrap(model, fsdp=True)
torch.manual_seed(0)
expected = nn.Sequential(Block(), Block())
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
full = {name: param.full_tensor() for name, param in sharded.named_parameters()}
assert all(torch.equal(full[name], value) for name, value in expected.named_parameters())
print(f"rank {parallel.rank}: rank 0's weights")
parallel.barrier()  # as a run ends (save_model's barrier, then close)
parallel.close()
'''


@pytest.mark.slow
def test_fsdp2_starts_every_rank_from_rank_0s_weights(tmp_path):
    """Machines that each built the model (the built-in tiny model is warm-started once per machine) may
    hold different copies: FSDP2's shards and the plain copy the engine samples from are rank 0's, as DDP's
    are (DDP broadcasts rank 0's parameters itself)."""
    (tmp_path / "fsdp_start.py").write_text(FSDP_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "fsdp_start.py")], env=environment(tmp_path), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "rank 0: rank 0's weights" in done.stdout and "rank 1: rank 0's weights" in done.stdout
