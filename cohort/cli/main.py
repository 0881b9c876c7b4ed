"""The `cohort` command: train (the default), eval, sft, report, chat, generate.

Bad input is a `CohortError`: printed as one line, exit code 2, no traceback (unless --debug).
"""

from __future__ import annotations

import os
import sys

from ..errors import CohortError

USAGE = """usage: cohort [train] [--option value ...]   GRPO training (no options: the built-in task)
       cohort train --nproc_per_node N [...]    the same on N processes (GPUs) through torchrun; --fsdp shards
       cohort eval --model DIR --task NAME [--split test] [--limit N] [--num_samples n] [--output FILE]
       cohort sft --model DIR --data_files FILE [--output_dir DIR] [--max_steps N] [--learning_rate LR]
       cohort report RUN_DIR [RUN_DIR ...] [--out DIR]
       cohort chat MODEL_DIR            cohort generate MODEL_DIR --prompts FILE
add --debug to any command for a full traceback on errors; `cohort train --help` lists every option"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    command = argv.pop(0) if argv and not argv[0].startswith("-") else "train"
    if command in ("-h", "--help", "help") or (argv[:1] in (["-h"], ["--help"]) and command != "train"):
        print(USAGE)
        return 0
    commands = {"train": _train, "eval": _eval, "sft": _sft, "report": _report, "chat": _chat, "generate": _generate}
    if command not in commands:
        print(f"cohort: unknown command {command!r}; choose one of {', '.join(commands)}", file=sys.stderr)
        return 2
    try:
        return commands[command](argv) or 0
    except CohortError as error:
        if debug:
            raise
        print(f"cohort: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # cohort.run.lifecycle.TrainingInterrupted: SIGINT/SIGTERM, checkpoint saved
        print(f"cohort: {stop}" if str(stop) else "cohort: interrupted", file=sys.stderr)
        return getattr(stop, "exit_code", 130)


def _train(argv: list[str]) -> int:
    from ..config import config_help, parse_config
    from ..tasks import get_task
    from ..algorithm.trainer import GRPOTrainer

    if argv[:1] in (["-h"], ["--help"]):
        print("usage: cohort train [--config file.yaml] [--nproc_per_node N] [--option value ...]\n\noptions:\n"
              + config_help())
        return 0
    argv, processes = _pop_option(argv, "nproc_per_node")
    task_name = _peek(argv, "task") or "arithmetic"
    task = get_task(task_name)
    defaults = dict(getattr(task, "default_config", {})) if _peek(argv, "model") is None else {}
    args = parse_config(argv, defaults=defaults)  # bad options fail here, once, before any rank starts
    if processes is not None and processes != "1":
        return _launch(argv, processes, args)
    # under torchrun every rank loads the rows; rank 0 alone says what it found
    quiet = os.environ.get("RANK", "0") != "0"
    train_rows, eval_rows = task_rows(task, args, log=(lambda *_: None) if quiet else print)
    try:
        trainer = GRPOTrainer(args.model, None, train_rows, args=args, eval_dataset=eval_rows, task=task)
        trainer.train()
    except RuntimeError as error:  # several ranks: a collective failed because another rank died or hung
        raise _lost_rank(error) from error
    return 0


def _lost_rank(error: RuntimeError) -> Exception:
    """A one-line CohortError for a failed collective under torchrun; any other error unchanged."""
    import torch.distributed as dist

    text = str(error)
    failed_collective = isinstance(error, getattr(dist, "DistError", ())) or any(
        marker in text for marker in ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out"))
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not failed_collective:
        return error
    first_line = text.strip().splitlines()[0][:200] if text.strip() else type(error).__name__
    return CohortError(f"rank {os.environ.get('RANK', '?')} stopped: a collective with the other ranks failed "
                       f"({first_line}); another rank died or hung (torchrun's report names it; --ddp_timeout "
                       "bounds the wait)")


def _launch(argv: list[str], processes: str, args) -> int:
    """`cohort train --nproc_per_node N ...`: run `torchrun --standalone --nproc_per_node N -m cohort
    train ...` (torch.distributed.run, PyTorch's launcher and its failure handling) and wait for it."""
    import signal
    import subprocess

    if not processes.isdigit() or int(processes) < 1:
        raise CohortError(f"--nproc_per_node {processes!r}: give the number of processes, e.g. --nproc_per_node 2")
    if os.environ.get("WORLD_SIZE"):
        raise CohortError("--nproc_per_node launches torchrun, but this process already runs under torchrun; "
                          "leave --nproc_per_node out")
    if args.model is None:  # build the warm-started tiny model once, not in every rank at the same time
        from ..models.tiny import tiny_model_dir

        tiny_model_dir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               "-m", "cohort", "train", *argv]
    child = subprocess.Popen(command)
    forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731 - SIGTERM to us reaches the ranks
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
    if code != 0:
        print(f"cohort: error: the {processes} training processes stopped with exit code {code} (torchrun's report "
              "above names the rank that failed first)", file=sys.stderr)
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

    `--data_files` is the training data only: the held-out rows come from `--eval_data_files`, else
    from the task's own test split (never from the training file, which would score memorised
    answers as held-out accuracy). Without either, there is no held-out evaluation, said in one line."""
    options = dict(seed=args.seed, data_files=args.data_files, subset=args.subset, levels=args.levels)
    train = task.load("train", **options)
    if not args.eval_limit:
        return train, None
    held_out_options = {**options, "data_files": args.eval_data_files, "subset": None, "size": args.eval_limit}
    try:
        held_out = task.load("test", **held_out_options)
    except CohortError as error:
        if args.eval_data_files is not None:
            raise
        log(f"no held-out evaluation: the task's test split is not available ({error}); "
            "pass --eval_data_files to evaluate on a file")
        return train, None
    return train, held_out[: args.eval_limit]


def _peek(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        key, _, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key.replace("-", "_") == name:
            return inline or (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _eval(argv: list[str]) -> int:
    from .eval import run_eval

    run_eval(argv)
    return 0


def _sft(argv: list[str]) -> int:
    from .sft import run_sft

    run_sft(argv)
    return 0


def _report(argv: list[str]) -> int:
    from ..telemetry.report import main as report_main

    return report_main(argv)


def _chat(argv: list[str]) -> int:
    from .chat import chat_main

    return chat_main(argv)


def _generate(argv: list[str]) -> int:
    from .chat import generate_main

    return generate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
