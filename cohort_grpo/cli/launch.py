"""`cohort-grpo train --nproc_per_node N [--nnodes M --node_rank R --master_addr HOST --master_port P]`: the job's
processes started through torchrun on this machine, and the one line that says how the job ended.

`torchrun_arguments` turns the node options into torchrun's (every bad value a one-line `CohortError`);
`launch_job` runs torchrun inside cohort_grpo.parallel.faults, which keeps the ranks' failures for that line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cohort_grpo.errors import CohortError

NODE_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port")


def torchrun_arguments(processes: str | None, nodes: dict[str, str]) -> list[str]:
    """torchrun's options for `--nproc_per_node N` and, on several machines, `--nnodes M --node_rank R
    --master_addr HOST [--master_port P]` (static rendezvous at HOST:P, which node 0's torchrun hosts);
    one machine without an address is `--standalone`. Every bad value is a one-line CohortError."""
    if processes is None:
        given = " / ".join(f"--{name}" for name in nodes)
        raise CohortError(f"{given} without --nproc_per_node: add --nproc_per_node N, the number of processes "
                          "torchrun starts on this machine (e.g. its GPUs; 1 for one process per machine)")
    if (whole_number(processes) or 0) < 1:
        raise CohortError(f"--nproc_per_node {processes!r}: give the number of processes, e.g. --nproc_per_node 2")
    count = whole_number(nodes.get("nnodes", "1"))
    if count is None or count < 1:
        raise CohortError(f"--nnodes {nodes['nnodes']!r}: give the number of machines, e.g. --nnodes 2 (the same "
                          "on every machine)")
    rank = nodes.get("node_rank")
    others = "1" if count == 2 else f"1 to {count - 1}"
    if rank is None and count > 1:
        raise CohortError(f"--nnodes {count} needs --node_rank: this machine's index, 0 on the machine at "
                          f"--master_addr and {others} on the others")
    if rank is not None and "nnodes" not in nodes and rank != "0":
        raise CohortError(f"--node_rank {rank!r} needs --nnodes M, the number of machines (without it there is one "
                          "machine, node 0)")
    if rank is not None and whole_number(rank) not in range(count):
        raise CohortError(f"--node_rank {rank!r} is outside [0, {count}): give this machine's index among the "
                          f"--nnodes {count} machines, 0 on the machine at --master_addr and {others} on the others")
    address = nodes.get("master_addr")
    if address is None and count > 1:
        raise CohortError(f"--nnodes {count} needs --master_addr: the address of the machine with --node_rank 0, "
                          "reachable from every machine (e.g. --master_addr 10.0.0.1), the same on all of them")
    if address is not None and (not address or any(ch.isspace() for ch in address) or address.startswith("-")):
        raise CohortError(f"--master_addr {address!r}: give the host name or IP address of the machine with "
                          "--node_rank 0, e.g. --master_addr 10.0.0.1")
    port = nodes.get("master_port")
    if port is not None and not 1 <= (whole_number(port) or 0) <= 65535:
        raise CohortError(f"--master_port {port!r}: give a TCP port number from 1 to 65535, free on the machine at "
                          "--master_addr and the same on every machine (default 29500)")
    if count == 1 and address is None and port is None:
        return ["--standalone", f"--nproc_per_node={whole_number(processes)}"]
    rendezvous = [f"--nnodes={count}", f"--node_rank={whole_number(rank or '0')}", f"--master_addr={address or '127.0.0.1'}"]
    if port is not None:
        rendezvous.append(f"--master_port={whole_number(port)}")
    return [*rendezvous, f"--nproc_per_node={whole_number(processes)}"]


def whole_number(value: str) -> int | None:
    """`value` as a whole number (ASCII digits only), else None."""
    return int(value) if value.isascii() and value.isdigit() else None


def stop_with_parent() -> None:
    """In a child process before it runs its program: ask Linux to send it SIGTERM when its parent dies
    (`PR_SET_PDEATHSIG`); nothing on other systems."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def check_split_tools(args, split) -> None:
    """Refuse sampling groups of `split` ranks for a run whose completions call tools (`--tools`, else the task's),
    known from the options: before torchrun starts a rank rather than in each once its model is loaded."""
    if not isinstance(split, int) or split <= 1:
        return
    from cohort_grpo.models.tensor_parallel import tools_split_refusal
    from cohort_grpo.tasks import get_task

    if args.tools if args.tools is not None else getattr(get_task(args.task), "tools", None):
        raise tools_split_refusal(split)


def launch_job(argv: list[str], launcher: list[str], args, processes: str, nodes: dict[str, str], placement) -> int:
    """`cohort-grpo train --nproc_per_node N [--nnodes M --node_rank R --master_addr HOST ...] ...`: run
    `torchrun <launcher> -m cohort_grpo train ...` on this machine (torch.distributed.run, PyTorch's launcher
    and its failure handling; `torchrun_arguments` gives <launcher>) for the job's `placement` and wait for it."""
    import shutil
    import signal
    import subprocess

    if os.environ.get("WORLD_SIZE"):
        raise CohortError("--nproc_per_node launches torchrun, but this process already runs under torchrun; "
                          "leave --nproc_per_node (and --nnodes, --node_rank, --master_addr, --master_port) out")
    check_split_tools(args, placement.split)
    from cohort_grpo.parallel.distributed import pick_device

    # the device of this machine's last process, as it will pick it: no GPU, or fewer GPUs than processes, is
    # refused here once rather than by every rank after torchrun started them
    pick_device(args.device, local_rank=int(processes) - 1, world_size=placement.world_size)
    from cohort_grpo.models.tiny import is_builtin_model
    from cohort_grpo.sft.builtin import builtin_model_dir, tiny_model_dir

    # Build the warm-started tiny model once per machine (in its own cache), not in every rank at the same
    # time. Machines may build copies that differ in the last bits (another CPU or GPU); the ranks start
    # from rank 0's weights all the same (DDP and `Parallel.wrap` broadcast them).
    if args.model is None:
        tiny_model_dir()
    elif is_builtin_model(args.model):
        builtin_model_dir(args.model)
    import tempfile

    from cohort_grpo.parallel.faults import REPORT_ENV, job_failure_line

    # torchrun runs inside cohort_grpo.parallel.faults, which keeps its failures for the one line below; the ranks leave
    # their own error lines in the same folder.
    reports = Path(tempfile.mkdtemp(prefix="cohort-faults-"))
    from cohort_grpo.run.failure import checkpoint_marks

    before = checkpoint_marks(Path(args.output_dir))  # a checkpoint the job stops with is one it wrote (or resumed)
    command = [sys.executable, "-m", "cohort_grpo.parallel.faults", str(reports / "torchrun.json"), *launcher, "-m", "cohort_grpo",
               "train", *argv]
    # torchrun runs in a session (process group) of its own, so that a signal reaches it once, through us, whether a
    # terminal sent it to our whole group (Ctrl-C) or a supervisor to our pid alone (`kill -INT`).
    # Outside our group, it must still not outlive us: killed outright (SIGKILL, which no handler forwards), we
    # leave it SIGTERM, and it stops as after any SIGTERM (Linux; elsewhere it runs on to its end).
    child = subprocess.Popen(command, env={**os.environ, REPORT_ENV: str(reports)},
                             start_new_session=True, preexec_fn=stop_with_parent)
    stops: list[int] = []

    def forward(signum, frame):  # SIGINT / SIGTERM to us reach the ranks, which finish their step and save
        stops.append(signum)
        child.send_signal(signum)

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, forward) for signum in forwarded}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    failure = job_failure_line(reports, placement) if code != 0 else None
    shutil.rmtree(reports, ignore_errors=True)
    if failure is not None and not stops:
        from cohort_grpo.run.failure import RESUME_HINT

        where = f" on node {nodes['node_rank']}" if int(nodes.get("nnodes", "1")) > 1 else ""
        ending = "" if RESUME_HINT in failure else f"; the job stopped{kept(args, before, nodes, ' — ')}"
        print(f"cohort: error: {failure}{where}{ending}", file=sys.stderr)
        return code
    if stops and code != 0:  # the ranks' own lines say what they saved
        print(f"cohort: the {processes} training processes stopped on {signal.Signals(stops[0]).name}"
              f"{kept(args, before, nodes, '; ')}", file=sys.stderr)
        return 128 + stops[0]
    if code != 0 and int(nodes.get("nnodes", "1")) > 1:
        print(f"cohort: error: the {processes} training process(es) of node {nodes['node_rank']} (of "
              f"{nodes['nnodes']} machines) stopped with exit code {code} (the log above shows why; a rank that "
              "lost a collective points to another machine's line)", file=sys.stderr)
    elif code != 0:
        print(f"cohort: error: the {processes} training processes stopped with exit code {code} (the log above "
              "shows why)", file=sys.stderr)
    return code


def kept(args, before: dict[str, int], nodes: dict[str, str], then: str) -> str:
    """How a stopped job's line ends: `--resume` when this machine sees a checkpoint in output_dir to continue from
    (`job_checkpoint`; `before`: output_dir when the job started), else that the job saved none; a machine other than
    node 0, which alone writes output_dir, may not see it, and points to node 0's line. `then` leads a clause."""
    from cohort_grpo.run.failure import job_checkpoint

    if job_checkpoint(Path(args.output_dir), before, bool(args.resume or args.resume_from_checkpoint)) is not None:
        return f"{then}continue from the newest checkpoint with --resume"
    if int(nodes.get("node_rank", "0")) > 0:
        return f"{then}node 0's line says whether a checkpoint to continue from was saved"
    return " before it saved a checkpoint"
