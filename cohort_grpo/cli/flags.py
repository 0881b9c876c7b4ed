"""The flags of `cohort-grpo eval` and `cohort-grpo sft`: each one's type, default and help (`Option`), and the small
`--name value` parser they share.

`cohort-grpo train` parses into `GRPOConfig` instead (`cohort_grpo.config.command_line.parse_config`); both read the argv
pairs through `cohort_grpo.config.command_line.option_pairs`, so the two spell options the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cohort_grpo.config.command_line import option_pairs
from cohort_grpo.errors import CohortError

HELP_FLAGS = ("-h", "--help")  # any command's help, wherever they stand among its options


@dataclass
class Option:
    type: type
    default: object = None
    help: str = ""
    default_text: str | None = None  # the default in words, where the value (None) depends on other options


def parse_options(argv: list[str], options: dict[str, Option], command: str) -> dict:
    """`--name value` / `--name=value` pairs (dashes or underscores) → {name: typed value}; unknown
    names and unconvertible values raise a one-line `CohortError` naming the option."""
    values = {name: option.default for name, option in options.items()}
    for key, raw in option_pairs(argv, command):
        if key not in options:
            raise CohortError(f"cohort {command}: unknown option --{key}; choose from "
                              + ", ".join(f"--{n}" for n in options))
        if raw is None:
            raise CohortError(f"cohort {command}: --{key} needs a value")
        values[key] = _convert(command, key, raw, options[key].type)
    return values


def _convert(command: str, key: str, raw: str, kind: type):
    if raw.lower() in ("none", "null"):
        return None
    try:
        return kind(raw)
    except ValueError:
        raise CohortError(f"cohort {command}: --{key} expects {kind.__name__}, got {raw!r}") from None


def mapping(raw: str) -> dict:
    """A JSON object given on the command line (`--chat_template_kwargs '{"enable_thinking": false}'`)."""
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(raw)
    return value


def options_help(options: dict[str, Option]) -> str:
    """One line per option: its name, the kind of value it takes, what it does and its default."""
    def default(option: Option) -> str:
        return option.default_text or ("none" if option.default is None else str(option.default))

    width = max(len(f"--{name} {o.type.__name__.upper()}") for name, o in options.items()) + 2
    return "\n".join(f"  {f'--{name} {o.type.__name__.upper()}':<{width}}{o.help} (default: {default(o)})"
                     for name, o in options.items())


def pick_device(spec: str) -> torch.device:
    """The torch device `--device auto|cpu|cuda[:N]` names; asking for CUDA without a GPU is a `CohortError`."""
    import torch  # here, not at the top: `cohort-grpo eval --help` and a mistyped option answer without it

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise CohortError(f"device {spec!r} asked for, but no CUDA GPU is available; use --device cpu")
    return torch.device(spec)
