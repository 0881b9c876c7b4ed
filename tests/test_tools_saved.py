"""Tools travel with the model: a tool defined in the training script itself is recorded in tools.json by
import name when importing the script is harmless, and otherwise the run warns, naming the tool and the fix.
Each case runs a small script in its own process, since `__main__` is what is being named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOOL = '''
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: the expression, e.g. 6*7
    """
    return str(eval(expression, {"__builtins__": {}}))
'''

# What the trainer does with its toolbox at the start of a run (GRPOTrainer.build), without a model.
SAVE = '''
def save_tools(*tools):
    from cohort_grpo.tools.toolbox import Toolbox

    for line in Toolbox(tools=list(tools), max_iterations=2).save("out"):
        print(line)
'''


def run_script(folder: Path, source: str, *argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    (cwd or folder).joinpath("out").mkdir(exist_ok=True)
    script = folder / "train.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script), *argv], cwd=cwd or folder, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def saved(folder: Path) -> dict:
    return json.loads((folder / "out" / "tools.json").read_text())


def test_a_guarded_script_tool_is_saved_by_name_and_loads_without_running_the_script(tmp_path):
    done = run_script(tmp_path, TOOL + SAVE + '''
if __name__ == "__main__":
    open("ran", "a").write("x")
    save_tools(calculator)
''')
    assert done.stdout == ""  # nothing to warn about
    assert saved(tmp_path)["tools"] == ["train:calculator"]
    # `cohort-grpo chat` / `cohort-grpo eval` in the same folder: the name imports the script, whose training code stays put
    check = ("from cohort_grpo.tools.toolbox import saved_toolbox; box = saved_toolbox('out'); "
             "print(box.tools[0].__module__, box.tools[0]('6*7'), box.max_iterations)")
    loaded = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["train", "42", "2"]
    assert (tmp_path / "ran").read_text() == "x"  # once, by the run itself


def test_a_script_that_trains_at_import_warns_at_the_start_with_the_fix(tmp_path):
    done = run_script(tmp_path, TOOL + SAVE + '''
rows = [{"prompt": "6*7"}]
save_tools(calculator, lambda x: x)
''')
    assert saved(tmp_path)["tools"] == []
    first, second = done.stdout.splitlines()
    assert first.startswith("warning: tool calculator is not saved in out/tools.json: `cohort-grpo chat` and `cohort "
                            "eval` on this model will run without it; calculator is defined in train.py, which runs "
                            "code when imported")
    assert 'if __name__ == "__main__":' in first and "move calculator into a module" in first
    assert "lambda" in second and "define it at the top level of a module" in second


def test_a_script_run_from_another_folder_is_not_saved_and_says_where_to_run_it(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    done = run_script(tmp_path, TOOL + SAVE + '''
if __name__ == "__main__":
    save_tools(calculator)
''', cwd=tmp_path / "elsewhere")
    assert json.loads((tmp_path / "elsewhere" / "out" / "tools.json").read_text())["tools"] == []
    assert "not in the current folder; run the script from its folder" in done.stdout


def test_a_script_named_like_a_standard_module_is_not_saved(tmp_path):
    script = tmp_path / "json_tools"
    script.mkdir()
    (script / "out").mkdir()
    (script / "calendar.py").write_text(TOOL + SAVE + 'if __name__ == "__main__":\n    save_tools(calculator)\n')
    done = subprocess.run([sys.executable, "calendar.py"], cwd=script, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((script / "out" / "tools.json").read_text())["tools"] == []  # `calendar` is the stdlib's
    assert done.stdout.startswith("warning: tool calculator is not saved") and "rename the script" in done.stdout


class EpisodeEnvironment:
    """An environment that plays episodes (as verifiers' and OpenEnv's do): no tools to save."""

    def __call__(self):
        return self

    def episode_turns(self, tokenizer, environments, template_kwargs=None):
        raise AssertionError("not sampled here")


def test_an_environment_that_plays_episodes_is_not_written_and_one_line_says_to_pass_it_again(tmp_path):
    from cohort_grpo.tools.toolbox import Toolbox

    given = Toolbox(tools=[], environment_factory=EpisodeEnvironment()).save(tmp_path)
    assert len(given) == 1 and given[0].startswith("note: environment EpisodeEnvironment plays episodes")
    assert "environment_factory=" in given[0] and "warning" not in given[0]
    assert json.loads((tmp_path / "tools.json").read_text())["environment"] is None
    # made by the task (e.g. --task verifiers:ENV_ID): the task makes it again, nothing to say
    assert Toolbox(tools=[], environment_factory=EpisodeEnvironment(), environment_from_task=True).save(tmp_path) == []
    assert json.loads((tmp_path / "tools.json").read_text())["environment"] is None
