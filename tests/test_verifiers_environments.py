"""verifiers environments train as they are: a single-turn and a multi-turn environment defined here (no hub),
each three steps on the tiny model with each rubric function logged as a reward; the rewards are the rubric's
own functions on each rollout's conversation, weighted as the rubric weighs them; the environment's messages
between turns are appended after the model's turns and left out of the loss."""

from __future__ import annotations

import json

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from helpers import episode_config, save_chat_tiny

torch.set_num_threads(1)

vf = pytest.importorskip("verifiers", reason='verifiers is not installed (pip install "cohort-grpo[verifiers]")')
if not hasattr(vf, "__getattr__") and not hasattr(vf, "MultiTurnEnv"):
    pytest.skip("verifiers >= 0.4 has no classic environments (pip install \"verifiers>=0.3,<0.4\")",
                allow_module_level=True)
from datasets import Dataset  # noqa: E402 - verifiers brings it

from cohort_grpo.tasks.verifiers import VerifiersEnvironment, parse_spec  # noqa: E402

FEEDBACK = "again"
QUESTIONS = [{"question": f"{a}+{b}", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]


def exact(completion, answer, parser) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


def has_digit(completion) -> float:
    texts = [m["content"] or "" for m in completion if m["role"] == "assistant"]
    return 1.0 if any(c.isdigit() for t in texts for c in t) else 0.0


class RetryEnv(vf.MultiTurnEnv):
    """Answers every turn with the same feedback until max_turns."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": FEEDBACK}]


def single_turn_env():
    rubric = vf.Rubric(funcs=[exact, has_digit], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(QUESTIONS), system_prompt="add", parser=vf.Parser(),
                            rubric=rubric)


def multi_turn_env():
    rubric = vf.Rubric(funcs=[exact, has_digit], weights=[1.0, 0.25])
    return RetryEnv(dataset=Dataset.from_list(QUESTIONS), system_prompt="add", parser=vf.Parser(), rubric=rubric,
                    max_turns=3)


class Recorded(VerifiersEnvironment):
    """Keeps every rollout it makes, to check them after the run."""

    def __init__(self, env):
        super().__init__(env)
        self.made = []

    def __call__(self):
        rollout = super().__call__()
        self.made.append(rollout)
        return rollout


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """The tiny model with a chat template, its end-of-turn token made likely (so turns end early)."""
    return save_chat_tiny(tmp_path_factory.mktemp("chat-tiny"), "add\n1+2\n")


config = episode_config


def trainer_for(env, chat_dir, tmp_path):
    source = Recorded(env)
    args = config(tmp_path, reward_weights=source.reward_weights)
    return source, GRPOTrainer(chat_dir, reward_funcs=source.reward_funcs, train_dataset=source.rows(),
                               environment_factory=source, args=args)


def rubric_total(rollout, weights) -> tuple[list[float], float]:
    """The rubric's functions called directly on the rollout's conversation, and their weighted sum."""
    state, parser = rollout.state, rollout.source.env.parser
    values = [exact(state["completion"], rollout.row["answer"], parser), has_digit(state["completion"])]
    return values, sum(v * w for v, w in zip(values, weights))


@pytest.mark.parametrize("make_env", [single_turn_env, multi_turn_env])
def test_three_steps_log_each_rubric_function_and_the_reward_is_the_rubrics(make_env, chat_dir, tmp_path):
    source, trainer = trainer_for(make_env(), chat_dir, tmp_path)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    weights = dict(zip(["exact", "has_digit"], source.reward_weights))
    for record in steps:
        assert record["env/faults"] == 0
        assert record["reward"] == pytest.approx(sum(w * record[f"rewards/{n}/mean"] for n, w in weights.items()),
                                                 abs=1e-6)
    scored = [r for r in source.made if r.metrics is not None]
    assert len(scored) == 3 * 4
    for rollout in scored:
        values, total = rubric_total(rollout, source.reward_weights[:2])
        assert [rollout.metrics["exact"], rollout.metrics["has_digit"]] == values
        assert rollout.state["reward"] == pytest.approx(total)


def test_the_environments_turns_are_appended_and_out_of_the_loss(chat_dir, tmp_path):
    source, trainer = trainer_for(multi_turn_env(), chat_dir, tmp_path)
    batch = trainer.sample(trainer.next_prompts())
    tokenizer = trainer.tokenizer if hasattr(trainer, "tokenizer") else trainer.processing_class
    feedback_ids = tokenizer(FEEDBACK + "\n", add_special_tokens=False)["input_ids"]
    appended_runs = 0
    for ids, mask, sampled, conversation in zip(batch.rollout.completion_ids, batch.rollout.completion_mask,
                                               batch.rollout.tool_mask, batch.completions):
        ids, sampled = ids[mask.bool()].tolist(), sampled[mask.bool()].tolist()
        runs = [i for i in range(len(ids)) if sampled[i] == 0 and (i == 0 or sampled[i - 1] == 1)]
        for start in runs:  # each run of unsampled tokens is the feedback the environment gave, whole or cut
            assert ids[start - 1] == tokenizer.eos_token_id
            assert ids[start:start + len(feedback_ids)] == feedback_ids[:len(ids) - start]
        appended_runs += len(runs)
        # the conversation: the model's turns, the environment's feedback after each turn that was continued
        assert sum(m["role"] == "user" for m in conversation) == len(runs)
        assert all(m["content"] == FEEDBACK for m in conversation if m["role"] == "user")
    assert appended_runs > 0, "no turn ended early: nothing was appended"
    assert torch.equal(batch.rollout.loss_mask, batch.rollout.completion_mask * batch.rollout.tool_mask)
    assert batch.rollout_metrics["env/turns"] > 1


def test_spec_arguments_and_bad_specs():
    assert parse_spec("my-env:n=100,hard=True,name=abc") == ("my-env", {"n": 100, "hard": True, "name": "abc"})
    with pytest.raises(CohortError, match="key=value"):
        parse_spec("my-env:oops")
    with pytest.raises(CohortError, match="environment's id"):
        parse_spec("")
