"""OpenEnv environments through `environment_factory`: a server (tests/openenv_counting_app.py) started on
127.0.0.1 by the run and stopped after it; three steps of training where the reward is the environment's
(the sum of its step rewards, checked against the actions the model took), its observations appended
between turns and out of the loss; a server that logs more than a pipe holds still answers; episodes
beyond the server's sessions are faults while the others play; and each fault (the server gone, a step too slow, a malformed reply)
ends its episodes with reward 0, counted in `env/faults`, while the step completes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from helpers import episode_config, save_chat_tiny

torch.set_num_threads(1)

pytest.importorskip("openenv.core.generic_client", reason='openenv-core is not installed (pip install "cohort-grpo[openenv]")')
from cohort_grpo.tasks.openenv import OpenEnvServer  # noqa: E402

APP = "openenv_counting_app:app"
HERE = str(Path(__file__).parent)
STEPS = 2  # the app's episode length
FIRST = "say a digit"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """The tiny model with a chat template, its end-of-turn token made likely (so turns end early)."""
    return save_chat_tiny(tmp_path_factory.mktemp("chat-tiny"), "say a digit\n")


config = episode_config


class Recorded:
    """The server's factory, keeping each episode it makes."""

    def __init__(self, factory):
        self.factory, self.made = factory, []
        self.episode_turns = factory.episode_turns

    def __call__(self):
        episode = self.factory()
        self.made.append(episode)
        return episode


def expected_reward(conversation) -> float:
    """The environment's reward, independently: 1 per model turn that reached it holding a digit."""
    said = [m["content"] for m in conversation if m["role"] == "assistant"][:STEPS]
    return float(sum(any(c.isdigit() for c in text) for text in said))


def test_three_steps_with_the_environments_reward_then_the_server_is_stopped(chat_dir, tmp_path, capsys):
    with OpenEnvServer(APP, pythonpath=[HERE]) as server:
        process = server.process
        source = Recorded(server.environments())
        trainer = GRPOTrainer(chat_dir, environment_factory=source, args=config(tmp_path))
        batch = trainer.sample(trainer.next_prompts())
        trainer.score(batch)
        # the first observation is the prompt; each completion's reward is its episode's summed step rewards
        played = [episode for episode in source.made if episode.prompt is not None]  # not the reward's probe
        assert len(played) == len(batch.completions)
        assert all(FIRST in episode.prompt[-1]["content"] for episode in played)
        rewards = [episode.get_reward() for episode in played]
        assert rewards == [expected_reward(c) for c in batch.completions]
        assert batch.rollout_metrics["env/faults"] == 0 and batch.rollout_metrics["env/turns"] >= 1
        observations = [m["content"] for c in batch.completions for m in c if m["role"] == "user"]
        assert observations and all(o.startswith("heard ") for o in observations)
        assert torch.equal(batch.rollout.loss_mask, batch.rollout.completion_mask * batch.rollout.tool_mask)
        trainer.train()
    assert process.poll() is not None, "the server outlived its with block"
    # not a tool set: tools.json holds no environment, and one line says a resumed run must be given it again
    assert json.loads((tmp_path / "tools.json").read_text())["environment"] is None
    assert "note: environment Recorded plays episodes" in capsys.readouterr().out
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["env/faults"] == 0 and r["reward"] == r["rewards/OpenEnvEpisode/mean"] for r in steps)


def faulty_step(chat_dir, tmp_path, server, **options):
    source = Recorded(server.environments(**options))
    trainer = GRPOTrainer(chat_dir, environment_factory=source, args=config(tmp_path))
    return source, trainer


def check_all_faulted(source, trainer, batch):
    trainer.score(batch)
    n = len(batch.completions)
    episodes = source.made[-n:]
    assert batch.rollout_metrics["env/faults"] == n
    assert [e.get_reward() for e in episodes] == [0.0] * n
    batch.advantages = trainer.estimate_advantages(batch)
    assert trainer.update(batch)["loss"] == pytest.approx(0.0, abs=1e-6)  # the step completes


def test_a_server_that_dies_ends_its_episodes_with_reward_0(chat_dir, tmp_path):
    with OpenEnvServer(APP, pythonpath=[HERE]) as server:
        source, trainer = faulty_step(chat_dir, tmp_path, server, step_timeout_s=5.0)
        server.process.kill()
        server.process.wait()
        check_all_faulted(source, trainer, trainer.sample(trainer.next_prompts()))


def test_a_step_slower_than_its_timeout_ends_its_episode(chat_dir, tmp_path):
    with OpenEnvServer(APP, pythonpath=[HERE], env={"COUNTING_MODE": "slow"}) as server:
        source, trainer = faulty_step(chat_dir, tmp_path, server, step_timeout_s=0.5)
        batch = trainer.sample(trainer.next_prompts())
        check_all_faulted(source, trainer, batch)


def test_a_malformed_reply_ends_its_episode(chat_dir, tmp_path):
    with OpenEnvServer(APP, pythonpath=[HERE], env={"COUNTING_MODE": "malformed"}) as server:
        source, trainer = faulty_step(chat_dir, tmp_path, server)
        check_all_faulted(source, trainer, trainer.sample(trainer.next_prompts()))


def test_a_server_that_logs_more_than_a_pipe_holds_still_answers(chat_dir, tmp_path):
    # Each step writes 64 KiB to the server's stderr: unread, the pipe fills and the server stops answering.
    with OpenEnvServer(APP, pythonpath=[HERE], env={"COUNTING_MODE": "chatty"}) as server:
        source, trainer = faulty_step(chat_dir, tmp_path, server, step_timeout_s=10.0)
        batch = trainer.sample(trainer.next_prompts())
        assert batch.rollout_metrics["env/faults"] == 0
        assert sum(episode.steps for episode in source.made) >= len(batch.completions)  # 64 KiB each, > 64 KiB


def test_episodes_beyond_the_servers_sessions_are_faults_and_the_rest_play(chat_dir, tmp_path):
    # 4 completions, 2 sessions: the first two resets hold the server's sessions, the last two are refused.
    with OpenEnvServer(APP, pythonpath=[HERE], env={"COUNTING_SESSIONS": "2"}) as server:
        source, trainer = faulty_step(chat_dir, tmp_path, server)
        batch = trainer.sample(trainer.next_prompts())
        played = [episode for episode in source.made if episode.prompt is not None]
        assert [episode.failed for episode in played] == [False, False, True, True]
        assert batch.rollout_metrics["env/faults"] == 2
        trainer.score(batch)
        assert [e.get_reward() for e in played[:2]] == [expected_reward(c) for c in batch.completions[:2]]


def test_an_app_that_does_not_import_is_refused_with_the_servers_last_line():
    server = OpenEnvServer("openenv_no_such_app:app", pythonpath=[HERE])
    with pytest.raises(CohortError, match=r"stopped as it started \(.*openenv_no_such_app"):
        server.start()
    assert server.process is None
