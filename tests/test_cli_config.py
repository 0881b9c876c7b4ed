"""`cohort-grpo train`'s configuration: one precedence rule for every option (built-in default < the task's
defaults < YAML < command line, the task named by either), `--print_config`, `--help` with the defaults
this invocation would use, every subcommand's own help, `--version`, greedy sampling refused, and every
recipe of docs/howto built from flags and from YAML to the same config."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

import cohort_grpo
from cohort_grpo.run.determinism import cpu_thread_count
from cohort_grpo.cli import main
from cohort_grpo.config.grpo_config import GRPOConfig
from cohort_grpo.config.command_line import config_help, describe_config, parse_config, resolve_config
from cohort_grpo.errors import CohortError
from cohort_grpo.config.output_dir import COMMAND_LINE_OUTPUT_DIR
from cohort_grpo.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
ARITHMETIC = get_task("arithmetic").default_config
GSM8K = get_task("gsm8k").default_config
GSM8K_ROWS = [{"question": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "3+4=7\n#### 7"},
              {"question": "A box holds 2 pens. How many pens in 5 boxes?", "answer": "5*2=10\n#### 10"}]


def write_yaml(path: Path, values: dict) -> str:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return str(path)


class Recorder:
    """Stands in for GRPOTrainer in `cohort-grpo train`: records what the command line built, trains nothing."""

    calls: list = []

    def __init__(self, model, reward_funcs, train_dataset, args=None, eval_dataset=None, task=None, **_):
        Recorder.calls.append(dict(model=model, rows=train_dataset, args=args, eval_rows=eval_dataset, task=task))

    def train(self):
        return []


@pytest.fixture
def recorder(monkeypatch):
    import cohort_grpo.trainer.grpo_trainer as trainer_module

    Recorder.calls = []
    monkeypatch.setattr(trainer_module, "GRPOTrainer", Recorder)
    return Recorder.calls


# ---- 1. one precedence rule ---------------------------------------------------------------------

def test_yaml_task_brings_its_defaults_and_is_the_task_that_trains(tmp_path, recorder, capsys):
    """The reported case: `task: gsm8k` and `model:` in YAML trained arithmetic with arithmetic's defaults."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    config = write_yaml(tmp_path / "g.yaml", {"task": "gsm8k", "model": "runs/arithmetic", "data_files": str(train),
                                              "eval_data_files": str(train)})
    assert main(["train", "--config", config]) == 0
    (call,) = recorder
    assert call["task"].name == "gsm8k" and call["args"].task == "gsm8k"
    assert call["model"] == "runs/arithmetic"
    assert call["rows"][0]["question"] == GSM8K_ROWS[0]["question"]  # gsm8k rows, not arithmetic problems
    args = call["args"]
    for name, value in GSM8K.items():  # gsm8k's defaults, none of arithmetic's
        assert getattr(args, name) == value, name
    assert args.levels == GRPOConfig.levels and args.seed == GRPOConfig.seed  # arithmetic's "3"/0 not applied
    # what the run records (metrics, trainer_state.json) is `args.to_dict()`: the resolved config
    assert args.to_dict() == resolve_config(["--config", config])[0].to_dict()


def test_precedence_default_task_yaml_cli(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", {"max_steps": 7, "beta": 0.1, "learning_rate": 3e-6})
    args, sources = resolve_config(["--config", config, "--beta", "0.2"])
    assert (args.task, sources["task"]) == ("arithmetic", "default")
    assert (args.epsilon, sources["epsilon"]) == (0.2, "default")
    assert (args.output_dir, sources["output_dir"]) == (ARITHMETIC["output_dir"], "task:arithmetic")
    assert (args.max_steps, sources["max_steps"]) == (7, f"yaml:{config}")
    assert (args.learning_rate, sources["learning_rate"]) == (3e-6, f"yaml:{config}")
    assert (args.beta, sources["beta"]) == (0.2, "cli")


def test_task_from_the_command_line_beats_the_yaml_task_and_the_yaml_still_beats_its_defaults(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", {"task": "arithmetic", "max_steps": 9})
    args, sources = resolve_config(["--config", config, "--task", "gsm8k"])
    assert (args.task, sources["task"]) == ("gsm8k", "cli")
    assert (args.output_dir, sources["output_dir"]) == (GSM8K["output_dir"], "task:gsm8k")
    assert (args.max_steps, sources["max_steps"]) == (9, f"yaml:{config}")
    assert args.levels == GRPOConfig.levels  # arithmetic's defaults are gone with arithmetic


@pytest.mark.parametrize("extra", [[], ["--model", "some/model"], ["--model=some/model", "--max_steps", "5"]])
def test_model_keeps_the_task_defaults(extra):
    args, sources = resolve_config(extra)
    assert args.output_dir == ARITHMETIC["output_dir"] and args.learning_rate == ARITHMETIC["learning_rate"]
    assert args.beta == ARITHMETIC["beta"] and sources["beta"] == "task:arithmetic"
    if "--max_steps" in extra:
        assert (args.max_steps, sources["max_steps"]) == (5, "cli")
    else:
        assert args.max_steps == ARITHMETIC["max_steps"]


def test_model_and_curriculum_follow_the_same_rule(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", {"model": "from/yaml", "curriculum": [
        {"task": "arithmetic", "steps": 5, "levels": "1"}, {"task": "gsm8k", "steps": 10}]})
    args, sources = resolve_config(["--config", config])
    assert args.model == "from/yaml" and args.curriculum[0] == {"task": "arithmetic", "steps": 5, "levels": "1"}
    args, sources = resolve_config(["--config", config, "--model", "from/cli", "--curriculum", "arithmetic:3"])
    assert (args.model, sources["model"]) == ("from/cli", "cli")
    assert (args.curriculum, sources["curriculum"]) == ([{"task": "arithmetic", "steps": 3}], "cli")


def test_data_without_a_task_is_the_generic_task_and_task_wins(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", {"data_files": "rows.jsonl"})
    for argv in (["--data_files", "rows.jsonl"], ["--config", config], ["--dataset_name", "org/data"]):
        args, sources = resolve_config(argv)
        assert (args.task, sources["task"]) == ("generic", "default")
        assert args.output_dir == COMMAND_LINE_OUTPUT_DIR  # the generic task has no defaults of its own
    assert resolve_config(["--data_files", "rows.jsonl", "--task", "gsm8k"])[0].task == "gsm8k"
    assert GRPOConfig().validate().task == "arithmetic"
    assert GRPOConfig(data_files="rows.jsonl").validate().task == "generic"


def test_parse_config_applies_the_same_rule(tmp_path):
    config = write_yaml(tmp_path / "run.yaml", {"task": "gsm8k"})
    assert parse_config(["--config", config]).output_dir == GSM8K["output_dir"]
    assert parse_config([], defaults={"max_steps": 3}).max_steps == 3  # explicit defaults stand in for the task's


def test_trl_alias_sets_the_field_and_its_source():
    args, sources = resolve_config(["--vllm_importance_sampling_mode", "sequence_mask"])
    assert args.importance_sampling_mode == "sequence_mask" and sources["importance_sampling_mode"] == "cli"


# ---- --print_config ---------------------------------------------------------------------------

def test_print_config_shows_each_value_and_source_and_does_not_train(tmp_path, tiny_dir, capsys, monkeypatch):
    import cohort_grpo.trainer.grpo_trainer as trainer_module

    monkeypatch.setattr(trainer_module.GRPOTrainer, "train", lambda self: pytest.fail("--print_config trained"))
    monkeypatch.chdir(tmp_path)  # the task's output_dir, runs/arithmetic, is made and removed here
    config = write_yaml(tmp_path / "g.yaml", {"task": "arithmetic", "model": tiny_dir, "device": "cpu"})
    assert main(["train", "--config", config, "--max_steps", "5", "--print_config"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0]: line for line in out.splitlines() if not line.startswith("#")}
    assert set(lines) == {f.name for f in dataclasses.fields(GRPOConfig)}
    assert re.search(r"^task: arithmetic +# yaml:" + re.escape(config) + "$", lines["task"])
    assert re.search(r"^model: \S+ +# yaml:", lines["model"])
    assert re.search(r"^max_steps: 5 +# cli$", lines["max_steps"])
    assert re.search(r"^output_dir: runs/arithmetic +# task:arithmetic$", lines["output_dir"])
    assert re.search(r"^epsilon: 0.2 +# default$", lines["epsilon"])
    assert re.search(r"^dtype: float32 +# default, resolved from auto$", lines["dtype"])
    # the printout is a YAML config that resolves to the same configuration, `auto` settled
    saved = tmp_path / "printed.yaml"
    saved.write_text(out)
    again = resolve_config(["--config", str(saved)])[0]
    asked = resolve_config(["--config", config, "--max_steps", "5"])[0]
    assert {name: value for name, value in again.to_dict().items() if asked.to_dict()[name] != value} == {
        "max_staleness": 1, "partial_rollouts": False, "importance_sampling_correction": False,
        "optimizer_state_dtype": "float32", "offload_optimizer": False, "gradient_checkpointing": False, "max_tokens_per_micro_batch": 0,
        "torch_compile": False, "dtype": "float32", "model_impl": "cohort", "cpu_threads": cpu_thread_count(),
        "rollout_tensor_parallel_size": 1, "max_concurrent_sequences": 256, "eval_strategy": "no"}
    assert not (tmp_path / "runs" / "arithmetic").exists()


def test_describe_config_round_trips_lists_and_curricula(tmp_path):
    args, sources = resolve_config(["--curriculum", "arithmetic:2,gsm8k:3", "--reward_funcs", "format,accuracy",
                                    "--reward_weights", "0.5,1", "--lora_target_modules", "q_proj,v_proj"])
    saved = tmp_path / "printed.yaml"
    saved.write_text(describe_config(args, sources))
    assert resolve_config(["--config", str(saved)])[0] == args


# ---- 2. help, version -------------------------------------------------------------------------

def help_of(capsys, *argv) -> str:
    assert main(list(argv)) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def option_line(text: str, name: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith(f"  --{name} ")]
    return line


def test_train_help_shows_the_defaults_a_bare_run_uses(capsys):
    text = help_of(capsys, "train", "--help")
    assert text.startswith("usage: cohort-grpo train")
    assert "default: runs/arithmetic (task:arithmetic)" in option_line(text, "output_dir")
    assert "default: 600 (task:arithmetic)" in option_line(text, "max_steps")
    assert "default: 2e-05 (task:arithmetic)" in option_line(text, "learning_rate")
    assert "default: 0.04 (task:arithmetic)" in option_line(text, "beta")
    assert "runs/cohort" not in option_line(text, "output_dir")
    flat = re.sub(r"\s+", " ", text)
    for f in dataclasses.fields(GRPOConfig):  # every option: its type or choices, its default and its help
        line = option_line(text, f.name)
        assert "default: " in line, line
        assert re.sub(r"\s+", " ", f.metadata["help"]) in flat, f.name
    assert "{grpo,bnpo,dapo,dr_grpo}" in option_line(text, "loss_type")
    assert "{group,batch,none}" in option_line(text, "scale_rewards")
    assert "{token_truncate,token_mask,sequence_truncate,sequence_mask}" in option_line(text, "importance_sampling_mode")
    assert "{constant,cosine,linear}" in option_line(text, "lr_scheduler_type")
    assert "{arithmetic,calculator,gsm8k,generic,shapes,reasoning_gym:NAME,verifiers:NAME}" in option_line(text, "task")
    assert " FLOAT " in option_line(text, "epsilon") and " INT " in option_line(text, "num_generations")
    assert "{true,false}" in option_line(text, "use_peft")
    assert "--print_config" in text and "--config FILE.yaml" in text and "--nproc_per_node N" in text


def test_train_help_follows_the_task_and_the_yaml_of_the_invocation(tmp_path, capsys):
    text = help_of(capsys, "train", "--task", "gsm8k", "--help")
    assert "default: runs/gsm8k (task:gsm8k)" in option_line(text, "output_dir")
    assert "default: 512 (task:gsm8k)" in option_line(text, "max_completion_length")
    assert "default: gsm8k (cli)" in option_line(text, "task")
    config = write_yaml(tmp_path / "run.yaml", {"task": "gsm8k", "max_steps": 12})
    text = help_of(capsys, "--config", config, "-h")  # `train` is the default command
    assert f"default: 12 (yaml:{config})" in option_line(text, "max_steps")
    assert "default: runs/gsm8k (task:gsm8k)" in option_line(text, "output_dir")
    # help never validates: options that would fail a run still show their help
    assert "default: 0.0" in option_line(help_of(capsys, "train", "--temperature", "0", "--help"), "temperature")


@pytest.mark.parametrize("command", ["eval", "sft", "report", "chat", "generate"])
def test_each_subcommand_has_its_own_help(capsys, command):
    text = help_of(capsys, command, "--help")
    assert text.startswith(f"usage: cohort-grpo {command}"), text[:200]
    assert "cohort-grpo report RUN_DIR" not in text or command == "report"  # not the global usage
    assert help_of(capsys, "help", command) == text


def test_help_after_other_options_is_help_not_an_error(capsys):
    text = help_of(capsys, "eval", "--model", "x", "--help")
    assert text.startswith("usage: cohort-grpo eval") and "--num_samples" in text
    assert help_of(capsys, "chat", "some/model", "-h").startswith("usage: cohort-grpo chat")
    assert help_of(capsys, "generate", "m", "--prompts", "p.txt", "--help").startswith("usage: cohort-grpo generate")


def test_global_help_and_version(capsys):
    text = help_of(capsys, "--help")
    assert text.startswith("usage: cohort-grpo [train]") and "cohort-grpo eval" in text and "--help" in text
    assert help_of(capsys, "help") == text
    assert help_of(capsys, "--version").strip() == f"cohort {cohort_grpo.__version__}"


def test_config_help_without_arguments_lists_the_built_in_defaults():
    text = config_help()
    assert "default: runs/cohort" in option_line(text, "output_dir")


# ---- 4. greedy sampling is refused --------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--temperature", "0"], ["temperature=0", "--temperature > 0", "0.7-1.0"]),
    (["--temperature", "-0.5"], ["temperature=-0.5", "--temperature > 0"]),
    (["--top_k", "1"], ["top_k=1", "identical", "--top_k 0"]),
    (["--min_p", "1"], ["min_p=1", "identical", "--min_p 0"]),
])
def test_settings_that_make_every_group_identical_are_refused(capsys, argv, words):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cohort: error: ")
    for word in words:
        assert word in err, err
    with pytest.raises(CohortError):
        GRPOConfig(**{argv[0][2:]: float(argv[1]) if "." in argv[1] else int(argv[1])}).validate()


def test_sampling_that_keeps_groups_diverse_is_accepted():
    for argv in (["--temperature", "0.7"], ["--top_k", "0"], ["--top_k", "20"], ["--min_p", "0.05"]):
        resolve_config(argv)


# ---- 6. every recipe of docs/howto runs from YAML with the same result --------------------------

# The recipes the guide promises; each must be one of the `cohort-grpo train` commands found in the pages.
RECIPES = {
    "GSM8K": ("gsm8k.md", "--task gsm8k --num_generations 8"),
    "curriculum": ("gsm8k.md", "--curriculum arithmetic:50,gsm8k:200"),
    "Dr. GRPO": ("gsm8k.md", "--loss_type dr_grpo"),
    "DAPO": ("gsm8k.md", "--loss_type dapo"),
    "GSPO": ("gsm8k.md", "--importance_sampling_level sequence"),
    "LoRA": ("memory.md", "--use_peft true"),
    "activation checkpointing": ("memory.md", "--max_memory_gib 36"),
    "resume": ("resume.md", "--resume"),
    "FSDP": ("multi-gpu.md", "--fsdp true"),
    "your own data": ("data.md", "--prompt_column question"),
    "first run": ("first-run.md", ""),
}
LIST_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig) if "list[" in str(f.type)} - {"curriculum"}


def train_commands() -> list[tuple[str, str, list[str]]]:
    """(page, the command as written, its option arguments) for every `cohort-grpo train` command in the
    fenced code blocks of docs/howto/*.md. `...` placeholders are dropped, with a flag left without a
    value; the launcher's options (--nproc_per_node, --nnodes, ...) are not config options."""
    found = []
    for page in sorted((ROOT / "docs" / "howto").glob("*.md")):
        fenced = re.findall(r"^```([^\n]*)\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M)
        for block in (body for language, body in fenced if language.strip() in ("", "bash", "sh", "shell")):
            for line in block.replace("\\\n", " ").splitlines():
                if not re.search(r"\bcohort-grpo train\b", line):
                    continue
                words = shlex.split(line, comments=True)
                if "cohort-grpo" not in words or "train" not in words[words.index("cohort-grpo"):]:
                    continue
                start = words.index("cohort-grpo")
                if words[start + 1:start + 2] != ["train"]:
                    continue
                argv, rest = [], words[start + 2:]
                for i, word in enumerate(rest):
                    if word == "...":
                        continue
                    if word.startswith("--") and "=" not in word and (i + 1 == len(rest) or rest[i + 1] == "..."):
                        if word[2:].replace("-", "_") in BARE_FLAGS:
                            argv.append(word)
                        continue  # `--model ...`: a placeholder, not an option
                    argv.append(word)
                for launcher_option in ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port"):
                    argv = drop_option(argv, launcher_option)
                found.append((page.name, " ".join(words[start:]), argv))
    return found


BARE_FLAGS = {f.name for f in dataclasses.fields(GRPOConfig) if f.type in ("bool", "bool | None")}


def drop_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word.startswith(f"--{name}="):
            continue
        if word == f"--{name}":
            skip = True
            continue
        out.append(word)
    return out


def as_yaml(argv: list[str]) -> dict:
    """The YAML a user would write for these flags: natural YAML scalars, lists as lists, a curriculum as
    a list of {task, steps} mappings."""
    values = {}
    i = 0
    while i < len(argv):
        key, has_inline, inline = argv[i][2:].partition("=")
        key = key.replace("-", "_")
        if has_inline:
            raw = inline
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            raw, i = argv[i + 1], i + 1
        else:
            raw = "true"
        i += 1
        if key == "curriculum":
            values[key] = [{"task": t, "steps": int(s)} for t, s in (part.split(":") for part in raw.split(","))]
        elif key in LIST_FIELDS:  # an empty flag ('') is an empty list, as a user writes it in YAML: []
            values[key] = [yaml.safe_load(part) for part in raw.split(",")] if raw else []
        else:
            values[key] = yaml.safe_load(raw)
    return values


COMMANDS = train_commands()


def test_the_guide_recipes_are_found_in_the_pages():
    for name, (page, flags) in RECIPES.items():
        assert any(p == page and flags in text for p, text, _ in COMMANDS), f"recipe {name!r} is not in docs/howto/{page}"


@pytest.mark.parametrize("page, text, argv", COMMANDS, ids=[f"{p}:{t[:60]}" for p, t, _ in COMMANDS])
def test_every_recipe_gives_the_same_config_from_yaml(tmp_path, page, text, argv):
    from_flags = resolve_config(argv)[0]
    config = write_yaml(tmp_path / "recipe.yaml", as_yaml(argv))
    from_yaml = resolve_config(["--config", config])[0]
    assert from_yaml == from_flags, f"{page}: {text}"
    assert from_yaml.to_dict() == from_flags.to_dict()
