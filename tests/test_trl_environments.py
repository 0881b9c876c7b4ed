"""TRL 1.16's `environment_factory` examples (docs/source/grpo_trainer.md, "Environments") with only the
import changed and the model swapped for `cohort:tiny-tools`: an environment whose `reset()` writes the
prompt, with no train_dataset, and one whose `get_reward()` is the whole reward, with no reward_funcs.

The built-in tools model is swapped for a one-step warm start of a smaller spec (cached under tmp), so
the name resolves as a user's would without the minutes the real warm start takes; the sizes of the run
are the test's, the shape of each script is TRL's."""

import random

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.sft import builtin
from cohort_grpo.models.tiny import TINY_TOOLS_MODEL, TINY_TOOLS_SPEC

torch.set_num_threads(1)

SPEC = dict(TINY_TOOLS_SPEC, hidden_size=16, intermediate_size=32, num_hidden_layers=1, sft_steps=1,
            sft_mix_steps=1, sft_batch_size=2)


@pytest.fixture(autouse=True)
def small_tools_model(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("COHORT_CACHE", str(tmp_path_factory.getbasetemp() / "cohort-cache"))
    monkeypatch.setitem(builtin.BUILDERS, TINY_TOOLS_MODEL,
                        lambda log=print: builtin.tiny_tools_model_dir(log=log, spec=SPEC))


def small(tmp_path, **overrides):
    """The run's sizes (TRL's example leaves them at their defaults)."""
    return GRPOConfig(**dict(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                             max_completion_length=12, max_prompt_length=64, output_dir=str(tmp_path), quiet=True,
                             seed=0, device="cpu", eval_limit=0), **overrides)


class IncrementEnv:
    """TRL's first example: the environment samples its task and writes the prompt."""

    made = []

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = random.randint(1, 6)
        IncrementEnv.made.append(self)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def test_an_environment_writes_the_prompt_without_a_train_dataset(tmp_path):
    IncrementEnv.made.clear()
    trainer = GRPOTrainer(model=TINY_TOOLS_MODEL,
                          args=small(tmp_path, max_steps=1, chat_template_kwargs={"enable_thinking": False}),
                          environment_factory=IncrementEnv)
    batch = trainer.sample(trainer.next_prompts())
    environments = batch.environments
    assert len(environments) == len(batch.rows) == 4
    texts = [trainer.tokenizer.decode(ids) for ids in batch.prompt_ids]
    # each completion's prompt is its own environment's reset() text, nothing else
    assert texts == [f"Increment the counter by {env.target}.\n" for env in environments]
    trainer.score(batch)
    assert batch.rewards.tolist() == [env.get_reward() for env in environments]
    trainer.train()
    history = trainer.history
    assert len(history) == 1 and "rewards/IncrementEnv/mean" in history[0]


def test_completions_jsonl_logs_the_prompt_the_environment_wrote(tmp_path):
    """The rows' own prompt is an empty user turn; what the model saw (and the log shows) is reset()'s text."""
    import json

    from cohort_grpo.telemetry.report import build_report

    trainer = GRPOTrainer(model=TINY_TOOLS_MODEL, args=small(tmp_path, max_steps=1), environment_factory=IncrementEnv)
    IncrementEnv.made.clear()
    trainer.train()
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert logged and len(logged) <= len(IncrementEnv.made)
    # completion i of the step was sampled in environment i (made in order, one per completion)
    assert [row["prompt"][-1] for row in logged] == [
        {"role": "user", "content": f"Increment the counter by {env.target}."} for env in IncrementEnv.made[:len(logged)]]
    page = build_report([tmp_path]).read_text()
    assert f"user: Increment the counter by {IncrementEnv.made[0].target}." in page


def test_num_train_epochs_needs_rows_the_environment_does_not_have(tmp_path):
    with pytest.raises(CohortError, match="num_train_epochs=1 counts passes over a train_dataset"):
        GRPOTrainer(model=TINY_TOOLS_MODEL, args=small(tmp_path, num_train_epochs=1), environment_factory=IncrementEnv)


class TargetEnv:
    """TRL's second example: the dataset holds the task, reset() reads its column, get_reward() scores."""

    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


def test_the_environments_reward_needs_no_reward_funcs(tmp_path):
    # TRL's Dataset.from_dict of these two columns, as rows (datasets is an optional extra here)
    dataset = [{"prompt": [{"role": "user", "content": f"Increment the counter to {i}."}], "target": i}
               for i in range(1, 7)]
    trainer = GRPOTrainer(model=TINY_TOOLS_MODEL, train_dataset=dataset, args=small(tmp_path, max_steps=1),
                          environment_factory=TargetEnv)
    batch = trainer.sample(trainer.next_prompts())
    assert [env.target for env in batch.environments] == [row["target"] for row in batch.rows]
    trainer.score(batch)
    assert batch.rewards.tolist() == [env.get_reward() for env in batch.environments]
    trainer.train()
    assert len(trainer.history) == 1


def test_without_any_reward_the_error_names_all_three_sources(tmp_path):
    class NoReward:
        def reset(self, **kwargs):
            return "Say hi."

    with pytest.raises(CohortError, match=r"pass reward_funcs=\[...\], a task, or an environment_factory whose "
                                          r"environment has get_reward\(\)"):
        GRPOTrainer(model=TINY_TOOLS_MODEL, args=small(tmp_path, max_steps=1), environment_factory=NoReward)
