"""`GRPOConfig` from the command line and YAML: the options read from argv and a YAML file under one
precedence rule (the built-in default < the task's defaults < the YAML file < the command line), each
value converted to its field's type or refused in one line; where each value came from; and the
`--help` and `--print_config` texts that show the options in their sections.
"""

from __future__ import annotations

import contextlib
import importlib
import dataclasses
import difflib
import json
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path

from cohort_grpo.config.choices import AUTO_OPTIONS, CHOICES, task_path, values_text
from cohort_grpo.config.grpo_config import ALIASES, GRPOConfig, default_task, unchecked
from cohort_grpo.errors import CohortError
from cohort_grpo.config.output_dir import COMMAND_LINE_OUTPUT_DIR
from cohort_grpo.config.sections import SECTIONS


def config_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(GRPOConfig)}


def _convert(name: str, raw, annotation) -> object:
    """Turn a string (CLI) or YAML value into the field's type, or a one-line error."""
    if name == "curriculum":  # a list of stage mappings, or the compact TASK:STEPS,… string
        from cohort_grpo.config.curriculum import parse_curriculum

        return parse_curriculum(raw)
    if name in AUTO_OPTIONS and str(raw).strip().lower() == "auto":
        return "auto"
    hint = typing.get_type_hints(GRPOConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = args[0] if args else hint
    if isinstance(raw, list) and any(typing.get_origin(arm) is list for arm in args):  # a YAML list
        base = next(arm for arm in args if typing.get_origin(arm) is list)
    if raw is None or (optional and isinstance(raw, str) and raw.lower() in ("none", "null")):
        if optional:
            return None
        raise CohortError(f"--{name} needs a value")
    if raw is False and base is str and "no" in CHOICES.get(name, ()):  # YAML reads an unquoted no as False
        return "no"
    origin = typing.get_origin(base)
    try:
        if origin is list:
            (item,) = typing.get_args(base)
            items = raw if isinstance(raw, list) else [x for x in str(raw).split(",") if x.strip()]
            return [item(x) if not isinstance(x, item) else x for x in items]
        if set(args) == {int, float}:  # a count of steps, or a fraction of the run: 10 stays a whole number
            number = float(raw)
            return int(number) if number.is_integer() else number
        if base is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("1", "true", "yes", "on"):
                return True
            if str(raw).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        if base is dict:  # a JSON object on the command line, a mapping in YAML
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise ValueError
            return value
        return base(raw)
    except (TypeError, ValueError):
        kind = values_text(name) if name in CHOICES else getattr(base, "__name__", str(base))
        raise CohortError(f"--{name} expects {kind}, got {raw!r}") from None


def _unknown(key: str, source: str) -> CohortError:
    close = difflib.get_close_matches(key, list(config_fields()), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return CohortError(f"unknown option {key!r} in {source}{hint}; see `cohort-grpo train --help`")


def load_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise CohortError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise CohortError(f"config file {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise CohortError(f"config file {path} must be a mapping of option: value")
    return data


def option_pairs(argv: list[str], command: str = ""):
    """Yield (name, value) for `--name value` / `--name=value` / bare `--name` (value None) arguments,
    dashes in names read as underscores; anything else is a one-line `CohortError`. Shared by
    `cohort-grpo train` (`parse_config`) and `cohort-grpo eval` / `cohort-grpo sft` (`cohort_grpo.cli.flags.parse_options`)."""
    prefix = f"cohort {command}: " if command else ""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            named = f" (a model: --model {arg})" if i == 0 and Path(arg).expanduser().exists() else ""
            raise CohortError(f"{prefix}unexpected argument {arg!r}; options look like --name value{named}")
        key, has_inline, inline = arg[2:].partition("=")
        value = None
        if has_inline:
            value = inline
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        yield key.replace("-", "_"), value
        i += 1


def task_defaults(name: str) -> dict:
    """The task's `default_config` (an unknown task is a one-line `CohortError` naming the choices). The task's
    class is found through the registry of built-in tasks (`choices.TASKS`, "module:attribute"), as a plugin
    entry point is: the config never imports the tasks' code, which sits above it."""
    module, attribute = task_path(name)[0].split(":")
    return dict(getattr(getattr(importlib.import_module(module), attribute), "default_config", {}) or {})


def resolve_config(argv: list[str], defaults_of: Callable[[str], dict] | None = None, *,
                   validate: bool = True) -> tuple[GRPOConfig, dict[str, str]]:
    """`--field value` / `--field=value` / `--flag` arguments (and `--config file.yaml`) → the config
    and, for every field, where its value came from: `default`, `task:<name>`, `yaml:<file>` or `cli`.

    One rule for every option, lowest first: built-in default < the task's defaults < YAML < command
    line. The task is the command line's `--task`, else the YAML's `task:`, else `default_task` (generic
    when the command line or YAML gives data_files or dataset_name, else arithmetic); its defaults
    (`defaults_of(name)`, by default `task_defaults`: its `default_config`) apply whatever else is given,
    `--model` included. `validate=False` (for --help) skips `GRPOConfig.validate`."""
    fields = config_fields()
    cli = {key: "true" if value is None else value for key, value in option_pairs(argv)}  # bare flag = true
    layers: list[tuple[str, dict]] = []
    if "config" in cli:
        path = cli.pop("config")
        if path == "true":
            raise CohortError("--config needs a YAML file: --config run.yaml")
        values = {}
        for key, value in load_yaml(path).items():
            key = str(key).replace("-", "_")
            if key not in fields:
                raise _unknown(key, "the YAML config")
            values[key] = _convert(key, value, fields[key].type)
        layers.append((f"yaml:{path}", values))
    values = {}
    for key, value in cli.items():
        if key not in fields:
            raise _unknown(key, "the command line")
        values[key] = _convert(key, value, fields[key].type)
    layers.append(("cli", values))

    given = {key: value for _, layer in layers for key, value in layer.items()}  # later layers win
    task = given.get("task") or default_task(given.get("data_files"), given.get("dataset_name"))
    defaults = (defaults_of or task_defaults)(task)
    unknown = sorted(set(defaults) - set(fields))
    if unknown:
        raise CohortError(f"task {task!r} has default options that are not GRPOConfig fields: {unknown}")
    layers.insert(0, (f"task:{task}", defaults))

    sources = {name: "default" for name in fields}
    resolved: dict = {"output_dir": COMMAND_LINE_OUTPUT_DIR}  # the command's default, not the running script's
    for source, layer in layers:
        for key, value in layer.items():
            resolved[key] = value
            sources[key] = source
    resolved["task"] = task  # given (the command line, the YAML) or chosen from the data
    with contextlib.nullcontext() if validate else unchecked():
        config = GRPOConfig(**resolved)
    if validate:
        aliased = {alias: sources[alias] for alias, _ in ALIASES}
        config = config.validate()
        for alias, name in ALIASES:  # a TRL name set cohort's field: the field's value came from there
            if aliased[alias] != "default":
                sources[name] = aliased[alias]
    return config, sources


def parse_config(argv: list[str], defaults: dict | None = None) -> GRPOConfig:
    """`--field value` / `--field=value` / `--flag` arguments (and `--config file.yaml`) → a validated
    `GRPOConfig`, by `resolve_config`'s rule; `defaults`, when given, stands in for the task's defaults."""
    lookup = None if defaults is None else (lambda _task: dict(defaults))
    return resolve_config(argv, lookup)[0]


# ---- showing a config: --print_config and --help ----------------------------------------------

def show_value(value) -> str:
    """A value as the command line writes it: none, true/false, comma-separated lists, curricula as TASK:STEPS."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        if all(set(v) == {"task", "steps"} for v in value):
            return ",".join(f"{v['task']}:{v['steps']}" for v in value)
        return _yaml_value(value)
    if isinstance(value, (list, tuple)):
        return ",".join(show_value(v) for v in value)
    return str(value)


def _yaml_value(value) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, allow_unicode=True, width=10**6)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def describe_config(config: GRPOConfig, sources: dict[str, str]) -> str:
    """`cohort-grpo train --print_config`: every option with its value and where the value came from, as a
    YAML file (`--config` reads it back to the same config). Given a run's resolved config
    (`cohort_grpo.run.resolve`), it holds the values the run uses, `auto` settled."""
    rows = [(f"{f.name}: {_yaml_value(getattr(config, f.name))}", sources.get(f.name, "default"))
            for f in dataclasses.fields(GRPOConfig)]
    width = max(len(text) for text, _ in rows) + 2
    head = ("# cohort-grpo train: the resolved configuration. Each value's source, lowest precedence first: "
            "default < task:<name> < yaml:<file> < cli; 'resolved from X': the value the run uses for X here")
    return "\n".join([head] + [f"{text:<{width}}# {source}" for text, source in rows])


def type_text(name: str) -> str:
    """The kind of value an option takes, for --help: {choice,...}, INT, FLOAT, STR, {true,false}, lists."""
    hint = typing.get_type_hints(GRPOConfig)[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    if name in CHOICES:
        text = "{" + ",".join(CHOICES[name]) + "}"
    elif name == "curriculum":
        text = "TASK:STEPS,..."
    else:
        bases = [a for a in args if a is not type(None)] or [hint]
        base = bases[0]
        if set(bases) == {int, float}:
            text = "INT|FLOAT"
        elif typing.get_origin(base) is list:
            (item,) = typing.get_args(base)
            text = f"{item.__name__.upper()},..."
        elif base is bool:
            text = "{true,false}"
        else:
            text = getattr(base, "__name__", str(base)).upper()
    return text + ("|none" if optional and name not in ("task",) else "")


def config_help(config: GRPOConfig | None = None, sources: dict[str, str] | None = None, width: int = 100) -> str:
    """Every option of `cohort-grpo train`: its kind (type or choices), the default this invocation would use
    and where that default comes from, and the field's help text, in the sections of `SECTIONS`."""
    config = config if config is not None else GRPOConfig(output_dir=COMMAND_LINE_OUTPUT_DIR)
    sources = sources or {}
    fields = config_fields()
    blocks = []
    for section in SECTIONS:
        lines = [f"{section.title}:"]
        for name in section.options:
            source = sources.get(name, "default")
            default = show_value(getattr(config, name))
            lines.append(f"  --{name} {type_text(name)}    default: {default}"
                         + ("" if source == "default" else f" ({source})"))
            lines.append(textwrap.fill(fields[name].metadata.get("help", ""), width=width,
                                       initial_indent=" " * 6, subsequent_indent=" " * 6,
                                       break_on_hyphens=False))  # a command or an option name stays whole
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)

