"""The `cohort-grpo` command: train (the default), eval, sft, report, chat, generate.

Bad input is a `CohortError`: printed as one line, exit code 2, no traceback (unless --debug).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from cohort_grpo.errors import CohortError, command_line

USAGE = """usage: cohort-grpo [train] [--option value ...]   GRPO training (no options: the built-in task)
       cohort-grpo train --config run.yaml [...]     options from a YAML file; flags override it
       cohort-grpo train --data_files F --reward_funcs module:function [--prompt_column C]   your own rows
       cohort-grpo train [...] --print_config        the run's resolved options (a --config file); no training
       cohort-grpo train --nproc_per_node N [...]    the same on N processes (GPUs) through torchrun; --fsdp shards
       cohort-grpo train --nproc_per_node N --nnodes M --node_rank R --master_addr HOST [...]   on each of M machines
       cohort-grpo eval --model DIR --task NAME [--split test] [--limit N] [--num_samples n] [--output FILE | --output_dir DIR]
       cohort-grpo sft --model DIR --data_files FILE [--output_dir DIR] [--max_steps N] [--learning_rate LR]
       cohort-grpo report RUN_DIR [RUN_DIR ...] [--out DIR]
       cohort-grpo chat MODEL_DIR            cohort-grpo generate [MODEL_DIR] --prompts FILE
       cohort-grpo --version
`cohort-grpo COMMAND --help` lists a command's options (`cohort-grpo train --task gsm8k --help`: with the defaults that
run would use); add --debug to any command for a full traceback on errors"""

HELP_FLAGS = ("-h", "--help")


@command_line()  # its errors name --flags, not GRPOConfig's keywords
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] in (["--version"], ["-V"]):
        from cohort_grpo import __version__

        print(f"cohort {__version__}")
        return 0
    if argv[:1] == ["help"]:  # `cohort help` is the overview; `cohort help CMD` is `cohort CMD --help`
        argv = argv[1:2] + ["--help"] if len(argv) > 1 else ["--help"]
    if argv[:1] in ([flag] for flag in HELP_FLAGS):
        print(USAGE)
        return 0
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "train"
    commands = {"train": _train, "eval": _eval, "sft": _sft, "report": _report, "chat": _chat, "generate": _generate}
    if command not in commands:
        print(f"cohort: unknown command {command!r}; choose one of {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        if any(arg in HELP_FLAGS for arg in argv):  # anywhere: `cohort-grpo eval --model x --help` is help
            return HELP[command](argv) or 0
        return commands[command](argv) or 0
    except CohortError as error:
        if debug:
            raise
        from cohort_grpo.parallel.faults import record_rank_error

        if not record_rank_error(str(error)):  # under our launcher, it prints the line of the rank that failed first
            print(f"cohort: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - a failure `train()` kept the run of is one line; others unchanged
        from cohort_grpo.run.failure import failure_line

        line = None if debug else failure_line(error)
        if line is None:
            raise
        from cohort_grpo.parallel.faults import record_rank_error

        if not record_rank_error(line):
            print(f"cohort: error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # cohort_grpo.run.lifecycle.TrainingInterrupted: SIGINT/SIGTERM, checkpoint saved
        if os.environ.get("RANK", "0") == "0":  # under torchrun every trainer rank stops alike: rank 0 says so
            print(f"cohort: {stop}" if str(stop) else "cohort: interrupted", file=sys.stderr)
        return getattr(stop, "exit_code", 130)


def exit_process(code: int) -> NoReturn:
    """End this process with `code`. A rank of a job of several processes (torchrun's WORLD_SIZE > 1) ends
    without the interpreter's teardown (`os._exit`, after flushing its streams): a gloo process group's worker
    thread may still be releasing its last collective's tensors while the interpreter finalizes, and a thread
    that needs the GIL then is stopped inside a C++ destructor, which aborts the process ("terminate called
    without an active exception") after the run finished. By now the run's files are written and closed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


TRAIN_USAGE = """usage: cohort-grpo train [--config FILE.yaml] [--task NAME] [--option value ...]
       cohort-grpo train --nproc_per_node N [...]     N processes (GPUs) through torchrun
       cohort-grpo train --nproc_per_node N --nnodes M --node_rank R --master_addr HOST [--master_port P] [...]
                                                 the same on every one of M machines, R = 0 .. M-1
       cohort-grpo train [...] --print_config         print the run's resolved options with their sources; no training

Each option's value comes from, lowest precedence first: the built-in default < the task's defaults (the
task that --task or the YAML's `task:` names) < the YAML file (--config) < the command line. The defaults
below are the ones this command would use, with their source when it is not the built-in default.
Options: --name value, --name=value, dashes or underscores; a bare --flag is true; lists are
comma-separated; none clears an optional value.

Tasks: arithmetic (built in, the default), calculator (built in: tool calls, with the cohort:tiny-tools
model), shapes (built in: images, with the cohort:tiny-vision model), gsm8k, generic, reasoning_gym:NAME
(reasoning-gym's generators; a mixture: reasoning_gym:A:2,B:1; pip install "cohort-grpo[envs]"),
verifiers:ENV_ID[:key=value,...] (an installed verifiers environment; pip install "cohort-grpo[verifiers]").
Data without --task (--data_files or --dataset_name) is the generic task:
prompts from --prompt_column, the other columns passed to --reward_funcs (built-in names or module:function;
a module in the current directory works), no held-out evaluation.

command options:
  --config FILE.yaml        options from a YAML file (option: value); flags override it
  --print_config            load the model, settle every auto option for this device and model, print
                            each option's value and source as YAML (a --config file), then exit untrained
  --nproc_per_node N        launch N processes through torchrun (DDP; --fsdp true shards the model)
  --nnodes M                with --nproc_per_node: M machines, each running this command (M × N ranks)
  --node_rank R             this machine's index, 0 .. M-1; node 0 alone logs and writes --output_dir
  --master_addr HOST        the address of the machine with --node_rank 0, reachable from all of them
  --master_port P           a free TCP port there, the same on every machine (default 29500)
  --debug                   a full traceback on errors
  --help                    this help (with --task, --config and other options: their defaults)"""


def _train_help(argv: list[str]) -> int:
    from cohort_grpo.config.command_line import config_help, resolve_config

    argv = [arg for arg in argv if arg not in HELP_FLAGS]
    for name in ("nproc_per_node", "print_config", *NODE_OPTIONS):
        argv, _ = _pop_option(argv, name)
    config, sources = resolve_config(argv, validate=False)
    print(TRAIN_USAGE + "\n\n" + config_help(config, sources))
    return 0


def _train(argv: list[str]) -> int:
    from cohort_grpo.config.command_line import resolve_config
    from cohort_grpo.tasks import get_task

    argv, processes = _pop_option(argv, "nproc_per_node")
    argv, print_config = _pop_option(argv, "print_config")
    nodes = {}
    for name in NODE_OPTIONS:
        argv, nodes[name] = _pop_option(argv, name)
    nodes = {name: value for name, value in nodes.items() if value is not None}
    launcher = torchrun_arguments(processes, nodes) if processes is not None or nodes else None
    args, sources = resolve_config(argv)  # bad options fail here, once, before any rank starts
    printing = print_config is not None and print_config.lower() not in ("false", "0", "no", "off")
    check_task_data(args)
    if launcher is not None and (processes != "1" or nodes):
        from cohort_grpo.parallel.placement import Placement

        # the job's ranks, checked against the options before torchrun starts any of them
        placement = Placement.from_config(args, int(processes) * int(nodes.get("nnodes", "1")))
        return _launch(argv + ["--print_config"] * printing, launcher, args, processes, nodes, placement)
    # only now, the options checked: the trainer brings torch and transformers (seconds), which a mistyped
    # option should not wait for
    from cohort_grpo.trainer.grpo_trainer import GRPOTrainer
    from cohort_grpo.run.sampling_rank import SamplingRank, is_sampling_rank

    _import_user_rewards_from_cwd(args)
    task = get_task(args.task)
    # --rollout_gpus: the last ranks only sample for the trainer ranks; they need no rows
    sampling = is_sampling_rank(args)
    if not sampling:
        # under torchrun every rank loads the rows; rank 0 alone says what it found (on stderr when the
        # resolved config is printed, so that stdout is the YAML alone)
        quiet = os.environ.get("RANK", "0") != "0"
        say = (lambda *_: None) if quiet else (lambda *line: print(*line, file=sys.stderr)) if printing else print
        train_rows, eval_rows = task_rows(task, args, log=say)
    try:
        if sampling:
            sampler_rank = SamplingRank(args.model, args, task=task)
            if printing:  # rank 0 prints the config; this rank joined the job's groups only to let it start
                sampler_rank.parallel.close()
            else:
                sampler_rank.serve()
            return 0
        trainer = GRPOTrainer(args.model, None, train_rows, args=args, eval_dataset=eval_rows, task=task, log=say)
        if printing:
            return print_resolved(trainer, args, sources)
        trainer.train()
    except RuntimeError as error:  # several ranks: a collective failed because another rank died or hung
        raise _lost_rank(error) from error
    except FileNotFoundError as error:  # several machines: rank 0's checkpoint is not on this one
        raise _unreachable_checkpoint(error, args) from error
    return 0


def print_resolved(trainer, settled, sources: dict[str, str]) -> int:
    """`--print_config`: the trainer's resolved config as YAML (rank 0), each value with its source (a value
    that resolution settled says so), then the trainer is let go untrained."""
    from cohort_grpo.config.command_line import describe_config
    from cohort_grpo.run.resolve import resolved_sources

    if trainer.parallel.is_main:
        print(describe_config(trainer.args, resolved_sources(settled, trainer.args, sources)))
    trainer.close_logs()
    trainer.discard_unused_output_dir()  # no run happened: a folder this build made goes again
    trainer.parallel.close()
    return 0


def check_task_data(args) -> None:
    """The data options fit the task, before anything loads: a generated task reads no data, the generic
    task needs rows and reward functions, `prompt_column` is the generic task's."""
    from cohort_grpo.tasks import get_task

    task = get_task(args.task)
    data = [f"--{name} {value}" for name, value in (("data_files", args.data_files),
                                                     ("dataset_name", args.dataset_name),
                                                     ("eval_data_files", args.eval_data_files)) if value is not None]
    if data and not getattr(task, "reads_data", True):
        raise CohortError(f"task {task.name} generates its problems and reads no data ({data[0]}); to train on "
                          "the file, leave out --task (or pass --task generic) and give --reward_funcs")
    if args.prompt_column != "prompt" and task.name != "generic":
        raise CohortError(f"--prompt_column {args.prompt_column} applies to your own rows (the generic task); task "
                          f"{task.name} builds its prompts itself")
    stages = [task.name] + [get_task(stage["task"]).name for stage in args.curriculum or []]  # a stage's bad name now
    if "generic" in stages and not args.reward_funcs:
        raise CohortError("your rows come with no reward functions: pass --reward_funcs NAME or module:function "
                          "(e.g. --reward_funcs my_rewards:correct), or --task NAME for a task's own")


def _import_user_rewards_from_cwd(args) -> None:
    """`--reward_funcs module:function` (and --tools, --environment) finds a module in the current directory,
    as `python -m cohort_grpo` does
    (the `cohort-grpo` script's own folder is first on sys.path, not the current directory)."""
    specs = [*(args.reward_funcs or []), *(args.tools or []), args.environment or ""]
    if any(":" in str(spec) for spec in specs) and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def _lost_rank(error: RuntimeError) -> Exception:
    """A one-line CohortError for a failed collective under torchrun; any other error unchanged."""
    from cohort_grpo.parallel.faults import lost_rank_error

    return lost_rank_error(error)


def _unreachable_checkpoint(error: FileNotFoundError, args) -> Exception:
    """A one-line CohortError when a rank resuming a run cannot find a file of the checkpoint that rank 0
    chose (its output_dir is not shared with this machine); any other error unchanged."""
    path = str(error.filename or "")
    resuming = args.resume or args.resume_from_checkpoint
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not resuming or "checkpoint-" not in path:
        return error
    return CohortError(f"rank {os.environ.get('RANK', '?')} cannot read {path}: rank 0 resumes from that checkpoint, "
                       "and every machine must reach it at the same path; put --output_dir on a filesystem all "
                       "machines share, or copy the checkpoint folder to that path on each machine")


NODE_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port")


def torchrun_arguments(processes: str | None, nodes: dict[str, str]) -> list[str]:
    """torchrun's options for `--nproc_per_node N` and, on several machines, `--nnodes M --node_rank R
    --master_addr HOST [--master_port P]` (static rendezvous at HOST:P, which node 0's torchrun hosts);
    one machine without an address is `--standalone`. Every bad value is a one-line CohortError."""
    if processes is None:
        given = " / ".join(f"--{name}" for name in nodes)
        raise CohortError(f"{given} without --nproc_per_node: add --nproc_per_node N, the number of processes "
                          "torchrun starts on this machine (e.g. its GPUs; 1 for one process per machine)")
    if (_whole(processes) or 0) < 1:
        raise CohortError(f"--nproc_per_node {processes!r}: give the number of processes, e.g. --nproc_per_node 2")
    count = _whole(nodes.get("nnodes", "1"))
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
    if rank is not None and _whole(rank) not in range(count):
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
    if port is not None and not 1 <= (_whole(port) or 0) <= 65535:
        raise CohortError(f"--master_port {port!r}: give a TCP port number from 1 to 65535, free on the machine at "
                          "--master_addr and the same on every machine (default 29500)")
    if count == 1 and address is None and port is None:
        return ["--standalone", f"--nproc_per_node={_whole(processes)}"]
    rendezvous = [f"--nnodes={count}", f"--node_rank={_whole(rank or '0')}", f"--master_addr={address or '127.0.0.1'}"]
    if port is not None:
        rendezvous.append(f"--master_port={_whole(port)}")
    return [*rendezvous, f"--nproc_per_node={_whole(processes)}"]


def _whole(value: str) -> int | None:
    """`value` as a whole number (ASCII digits only), else None."""
    return int(value) if value.isascii() and value.isdigit() else None


def _launch(argv: list[str], launcher: list[str], args, processes: str, nodes: dict[str, str], placement) -> int:
    """`cohort-grpo train --nproc_per_node N [--nnodes M --node_rank R --master_addr HOST ...] ...`: run
    `torchrun <launcher> -m cohort_grpo train ...` on this machine (torch.distributed.run, PyTorch's launcher
    and its failure handling; `torchrun_arguments` gives <launcher>) for the job's `placement` and wait for it."""
    import shutil
    import signal
    import subprocess

    if os.environ.get("WORLD_SIZE"):
        raise CohortError("--nproc_per_node launches torchrun, but this process already runs under torchrun; "
                          "leave --nproc_per_node (and --nnodes, --node_rank, --master_addr, --master_port) out")
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
    from pathlib import Path

    from cohort_grpo.parallel.faults import REPORT_ENV, job_failure_line

    # torchrun runs inside cohort_grpo.parallel.faults, which keeps its failures for the one line below; the ranks leave
    # their own error lines in the same folder.
    reports = Path(tempfile.mkdtemp(prefix="cohort-faults-"))
    command = [sys.executable, "-m", "cohort_grpo.parallel.faults", str(reports / "torchrun.json"), *launcher, "-m", "cohort_grpo",
               "train", *argv]
    child = subprocess.Popen(command, env={**os.environ, REPORT_ENV: str(reports)})
    stops: list[int] = []

    def forward(signum, frame):  # SIGTERM to us reaches the ranks, which finish their step and save
        stops.append(signum)
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C reached torchrun too (same process group): wait for it
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    failure = job_failure_line(reports, placement) if code != 0 else None
    shutil.rmtree(reports, ignore_errors=True)
    if failure is not None and not stops:
        from cohort_grpo.run.failure import RESUME_HINT

        where = f" on node {nodes['node_rank']}" if int(nodes.get("nnodes", "1")) > 1 else ""
        ending = "" if RESUME_HINT in failure else "; the job stopped — continue from the newest checkpoint with --resume"
        print(f"cohort: error: {failure}{where}{ending}", file=sys.stderr)
        return code
    if stops and code != 0:  # the ranks' own lines say what they saved
        print(f"cohort: the {processes} training processes stopped on {signal.Signals(stops[0]).name}; continue "
              "from the newest checkpoint with --resume", file=sys.stderr)
        return 128 + stops[0]
    if code != 0 and int(nodes.get("nnodes", "1")) > 1:
        print(f"cohort: error: the {processes} training process(es) of node {nodes['node_rank']} (of "
              f"{nodes['nnodes']} machines) stopped with exit code {code} (the log above shows why; a rank that "
              "lost a collective points to another machine's line)", file=sys.stderr)
    elif code != 0:
        print(f"cohort: error: the {processes} training processes stopped with exit code {code} (the log above "
              "shows why)", file=sys.stderr)
    return code


def _pop_option(argv: list[str], name: str) -> tuple[list[str], str | None]:
    """`argv` without `--name value` / `--name=value`, and that value (None when absent)."""
    for i, arg in enumerate(argv):
        key, has_inline, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key.replace("-", "_") == name:
            if has_inline:
                return argv[:i] + argv[i + 1:], inline
            value = argv[i + 1] if i + 1 < len(argv) else ""
            return argv[:i] + argv[i + 2:], value
    return argv, None


def task_rows(task, args, log=print):
    """The task's training rows and held-out rows, from the options that apply to it.

    `--data_files` / `--dataset_name` is the training data only: the held-out rows come from
    `--eval_data_files`, else from the test split (`dataset_test_split`) of `--dataset_name` or of the
    task's own data (never from the training file, which would score memorised answers as held-out
    accuracy). Without either, or for a task with no verifier (the generic task), there is no held-out
    evaluation, said in one line."""
    options = dict(seed=args.seed, data_files=args.data_files, subset=args.subset, levels=args.levels)
    options.update({name: getattr(args, name) for name in ("dataset_name", "dataset_config")
                    if getattr(args, name) is not None})
    if task.name == "generic":
        options["prompt_column"] = args.prompt_column
    train = task.load(args.dataset_train_split, **options)
    if not args.eval_limit:
        return train, None
    if not hasattr(task, "is_correct"):
        log(f"no held-out evaluation: the {task.name} task has no verifier to score answers with (--task "
            "arithmetic or gsm8k have one); training goes on")
        return train, None
    held_out_options = {**options, "data_files": args.eval_data_files, "subset": None, "size": args.eval_limit}
    if args.eval_data_files is not None:
        held_out_options.pop("dataset_name", None)
    try:
        held_out = task.load(args.dataset_test_split, **held_out_options)
    except CohortError as error:
        if args.eval_data_files is not None:
            raise
        log(f"no held-out evaluation: the task's test split is not available ({error}); "
            "pass --eval_data_files to evaluate on a file")
        return train, None
    return train, held_out[: args.eval_limit]


def _eval_help(argv: list[str]) -> int:
    from cohort_grpo.cli.eval import run_eval

    run_eval(["--help"])
    return 0


def _sft_help(argv: list[str]) -> int:
    from cohort_grpo.cli.sft import run_sft

    run_sft(["--help"])
    return 0


def _argparse_help(command) -> int:
    """The help of a command whose module parses with argparse (chat, generate, report): its own
    parser prints it, from its own argument list, and exits."""
    try:
        return command(["--help"]) or 0
    except SystemExit as done:
        return done.code or 0


HELP = {
    "train": _train_help,
    "eval": _eval_help,
    "sft": _sft_help,
    "report": lambda argv: _argparse_help(_report),
    "chat": lambda argv: _argparse_help(_chat),
    "generate": lambda argv: _argparse_help(_generate),
}


def _eval(argv: list[str]) -> int:
    from cohort_grpo.cli.eval import run_eval

    run_eval(argv)
    return 0


def _sft(argv: list[str]) -> int:
    from cohort_grpo.cli.sft import run_sft

    run_sft(argv)
    return 0


def _report(argv: list[str]) -> int:
    from cohort_grpo.telemetry.report import main as report_main

    return report_main(argv)


def _chat(argv: list[str]) -> int:
    from cohort_grpo.cli.chat_flags import chat_parser

    chat_parser().parse_args(argv)  # --help and bad options answer here, before torch loads
    from cohort_grpo.cli.chat_tools import chat_main

    return chat_main(argv)


def _generate(argv: list[str]) -> int:
    from cohort_grpo.cli.chat_flags import generate_parser

    generate_parser().parse_args(argv)  # --help and bad options answer here, before torch loads
    from cohort_grpo.cli.generate import generate_main

    return generate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
