"""`cohort-grpo train`: its help, the options only the command line has (--nproc_per_node and the node options,
--print_config), the task's rows, then the trainer (or, on a rank that only samples, the `SamplingRank`) run on
this process, or the job launched on several (launch.py).
"""

from __future__ import annotations

import os
import sys

from cohort_grpo.cli.flags import HELP_FLAGS
from cohort_grpo.cli.launch import NODE_OPTIONS, launch_job, torchrun_arguments
from cohort_grpo.errors import CohortError

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


def train_help(argv: list[str]) -> int:
    """`cohort-grpo train --help`: the usage, then every option with the default the rest of `argv` would give it."""
    from cohort_grpo.config.command_line import config_help, resolve_config

    argv = [arg for arg in argv if arg not in HELP_FLAGS]
    for name in ("nproc_per_node", "print_config", *NODE_OPTIONS):
        argv, _ = pop_option(argv, name)
    config, sources = resolve_config(argv, validate=False)
    print(TRAIN_USAGE + "\n\n" + config_help(config, sources))
    return 0


def run_train(argv: list[str]) -> int:
    """`cohort-grpo train ...`: the run `argv` asks for, on this process or as a job of several (`launch_job`)."""
    from cohort_grpo.config.command_line import resolve_config
    from cohort_grpo.tasks import get_task

    argv, processes = pop_option(argv, "nproc_per_node")
    argv, print_config = pop_option(argv, "print_config")
    nodes = {}
    for name in NODE_OPTIONS:
        argv, nodes[name] = pop_option(argv, name)
    nodes = {name: value for name, value in nodes.items() if value is not None}
    launcher = torchrun_arguments(processes, nodes) if processes is not None or nodes else None
    args, sources = resolve_config(argv)  # bad options fail here, once, before any rank starts
    printing = print_config is not None and print_config.lower() not in ("false", "0", "no", "off")
    check_task_data(args)
    if launcher is not None and (processes != "1" or nodes):
        from cohort_grpo.parallel.placement import Placement

        # the job's ranks, checked against the options before torchrun starts any of them
        placement = Placement.from_config(args, int(processes) * int(nodes.get("nnodes", "1")))
        return launch_job(argv + ["--print_config"] * printing, launcher, args, processes, nodes, placement)
    # only now, the options checked: the trainer brings torch and transformers (seconds), which a mistyped
    # option should not wait for
    from cohort_grpo.trainer.grpo_trainer import GRPOTrainer
    from cohort_grpo.run.sampling_rank import SamplingRank, is_sampling_rank

    import_user_rewards_from_cwd(args)
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
        raise lost_rank(error) from error
    except FileNotFoundError as error:  # several machines: rank 0's checkpoint is not on this one
        raise unreachable_checkpoint(error, args) from error
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
    held_out_task, held_out_options = held_out_source(task, args, options, log)
    if not hasattr(held_out_task, "is_correct"):
        log(f"no held-out evaluation: the {held_out_task.name} task has no verifier to score answers with (--task "
            "arithmetic or gsm8k have one); training goes on")
        return train, None
    try:
        held_out = held_out_task.load(args.dataset_test_split, **held_out_options)
    except CohortError as error:
        if args.eval_data_files is not None:
            raise
        log(f"no held-out evaluation: the task's test split is not available ({error}); "
            "pass --eval_data_files to evaluate on a file")
        return train, None
    return train, held_out[: args.eval_limit]


def held_out_source(task, args, options: dict, log=print) -> tuple[object, dict]:
    """The task whose held-out rows the run evaluates on and its load options (`options`: the training rows'):
    `task`, or in a curriculum run its last stage's task (cohort_grpo/tasks/curriculum.py), which takes the data
    options of `task` only when it is that task, and the stage's own `levels`."""
    from cohort_grpo.tasks.curriculum import Curriculum

    held_out = {**options, "data_files": args.eval_data_files, "subset": None, "size": args.eval_limit}
    if args.eval_data_files is not None:
        held_out.pop("dataset_name", None)
    curriculum = Curriculum.from_config(args)
    if curriculum is None:
        return task, held_out
    stage = curriculum.held_out_stage
    if "levels" in stage.options:
        held_out["levels"] = stage.options["levels"]
    if stage.task != args.task:
        for name in ("dataset_name", "dataset_config", "prompt_column"):  # --task's data, not this task's
            held_out.pop(name, None)
        log(f"held-out evaluation on {stage.task}, the curriculum's last stage (not --task {args.task})")
    return curriculum.held_out_task(), held_out


def import_user_rewards_from_cwd(args) -> None:
    """`--reward_funcs module:function` (and --tools, --environment) finds a module in the current directory,
    as `python -m cohort_grpo` does
    (the `cohort-grpo` script's own folder is first on sys.path, not the current directory)."""
    specs = [*(args.reward_funcs or []), *(args.tools or []), args.environment or ""]
    if any(":" in str(spec) for spec in specs) and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def lost_rank(error: RuntimeError) -> Exception:
    """A one-line CohortError for a failed collective under torchrun; any other error unchanged."""
    from cohort_grpo.parallel.faults import lost_rank_error

    return lost_rank_error(error)


def unreachable_checkpoint(error: FileNotFoundError, args) -> Exception:
    """A one-line CohortError when a rank resuming a run cannot find a file of the checkpoint that rank 0
    chose (its output_dir is not shared with this machine); any other error unchanged."""
    path = str(error.filename or "")
    resuming = args.resume or args.resume_from_checkpoint
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not resuming or "checkpoint-" not in path:
        return error
    return CohortError(f"rank {os.environ.get('RANK', '?')} cannot read {path}: rank 0 resumes from that checkpoint, "
                       "and every machine must reach it at the same path; put --output_dir on a filesystem all "
                       "machines share, or copy the checkpoint folder to that path on each machine")


def pop_option(argv: list[str], name: str) -> tuple[list[str], str | None]:
    """`argv` without `--name value` / `--name=value`, and that value (None when absent)."""
    for i, arg in enumerate(argv):
        key, has_inline, inline = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key.replace("-", "_") == name:
            if has_inline:
                return argv[:i] + argv[i + 1:], inline
            value = argv[i + 1] if i + 1 < len(argv) else ""
            return argv[:i] + argv[i + 2:], value
    return argv, None
