"""The `cohort-grpo` command: train (the default), eval, sft, report, chat, generate.

Bad input is a `CohortError`: printed as one line, exit code 2, no traceback (unless --debug).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from cohort_grpo.cli.flags import HELP_FLAGS
from cohort_grpo.cli.train import run_train, train_help
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
    commands = {"train": run_train, "eval": _eval, "sft": _sft, "report": _report, "chat": _chat, "generate": _generate}
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
    "train": train_help,
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
    from cohort_grpo.cli.chat_flags import chat_parser, parsed

    parsed(chat_parser(), argv)  # --help and bad options answer here, before torch loads
    from cohort_grpo.cli.chat_tools import chat_main

    return chat_main(argv)


def _generate(argv: list[str]) -> int:
    from cohort_grpo.cli.chat_flags import generate_parser, parsed

    parsed(generate_parser(), argv)  # --help and bad options answer here, before torch loads
    from cohort_grpo.cli.generate import generate_main

    return generate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
