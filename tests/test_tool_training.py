"""GRPO on tool-calling rollouts through `GRPOTrainer(tools=[...])`: the model calls, the tool runs, its
result is appended, the model answers; the loss is over the model's own tokens only (tool results out, as
TRL's tool_mask), the step logs tools/call_frequency, and environments (TRL's environment_factory) get
reset on their rows, expose their methods as tools and add their get_reward to the reward.

The policy is a tiny model of the built-in tools tokenizer taught, in a few seconds of supervised
steps, to call `add` on a handful of problems: a real model sampling real calls."""

import json

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.sft.sft_tools import encode_trajectory
from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny import build_model, build_tools_tokenizer

torch.set_num_threads(1)

SMALL = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
PROBLEMS = [(2, 3), (4, 1), (6, 2), (3, 3), (7, 1), (5, 4)]


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def rows():
    return [{"prompt": [{"role": "user", "content": f"{a}+{b}=?"}], "solution": str(a + b)} for a, b in PROBLEMS]


def trajectory(a, b):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [{"role": "user", "content": f"{a}+{b}=?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(a + b)},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"}]


def answer_reward(prompts, completions, solution, **_):
    """1 when the last assistant message's <answer> is the sum."""
    out = []
    for messages, gold in zip(completions, solution):
        text = [m for m in messages if m["role"] == "assistant"][-1]["content"]
        out.append(1.0 if f"<answer>{gold}</answer>" in text else 0.0)
    return out


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory):
    """A tiny model taught to call `add` and answer with its result (supervised, ~5 s)."""
    tokenizer = build_tools_tokenizer()
    model = build_model(tokenizer, seed=0, spec=SMALL)
    encoded = [encode_trajectory(tokenizer, trajectory(a, b)) for a, b in PROBLEMS]
    width = max(len(p) + len(c) for p, c, _ in encoded)
    ids = torch.zeros(len(encoded), width, dtype=torch.long)
    weights = torch.zeros(len(encoded), width)
    for i, (prompt, completion, mask) in enumerate(encoded):
        ids[i, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        weights[i, len(prompt):len(prompt) + len(completion)] = torch.tensor(mask, dtype=torch.float)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(150):
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="none")
        loss = (loss * weights[:, 1:].reshape(-1)).sum() / weights.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = tmp_path_factory.mktemp("caller")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def config(tmp_path, **overrides):
    base = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=80, max_prompt_length=32,
                max_steps=1, learning_rate=1e-4, output_dir=str(tmp_path), quiet=True, seed=0, beta=0.0,
                temperature=1.0, loss_type="dapo", eval_limit=0, logging_steps=1)
    base.update(overrides)
    return GRPOConfig(**base)


@pytest.mark.cpu("a logged loss compared to 1e-5: float32 CPU arithmetic")
def test_tools_train_log_call_frequency_and_leave_tool_results_out_of_the_loss(caller_dir, tmp_path):
    trainer = GRPOTrainer(caller_dir, [answer_reward], rows(), args=config(tmp_path), tools=[add])
    batch = trainer.sample(trainer.next_prompts())
    assert batch.rollout.tool_mask is not None and (batch.rollout.tool_mask == 0).any(), "no tool was called"
    # completions are conversations: the call, the tool's result, the answer
    called = [c for c in batch.completions if any(m["role"] == "tool" for m in c)]
    results = [m["content"] for c in called for m in c if m["role"] == "tool"]
    # a sampled call the tool cannot take (bad JSON at T = 1) is a failure the model sees, not a crash
    assert all(r.isdigit() or r.startswith("{'error'") for r in results) and any(r.isdigit() for r in results)
    assert batch.rollout_metrics["tools/call_frequency"] == pytest.approx(len(called) / len(batch.completions))
    trainer.score(batch)
    batch.advantages = trainer.estimate_advantages(batch)
    assert batch.advantages.abs().sum() > 0, "every group had equal rewards: nothing to compare"
    record = trainer.update(batch)
    # DAPO's token-level loss at ratio 1: -Σ_i A_i·n_i / Σ_i n_i over the model's own tokens n_i
    own = batch.rollout.loss_mask.sum(dim=1).double()
    everything = batch.rollout.completion_mask.sum(dim=1).double()
    expected = -(batch.advantages.double() * own).sum() / own.sum()
    with_tool_tokens = -(batch.advantages.double() * everything).sum() / everything.sum()
    assert record["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert abs(float(expected - with_tool_tokens)) > 1e-4, "the check must tell the two masks apart"


@pytest.mark.slow
def test_a_run_with_tools_logs_tools_metrics_and_records_its_tools(caller_dir, tmp_path):
    trainer = GRPOTrainer(caller_dir, [answer_reward], rows(), args=config(tmp_path, max_steps=2), tools=[add])
    trainer.train()
    history = trainer.history
    assert all(r["tools/call_frequency"] > 0 for r in history)
    assert all(0.0 <= r["tools/failure_frequency"] <= 1.0 for r in history)
    saved = json.loads((tmp_path / "tools.json").read_text())
    assert saved["tools"] == ["test_tool_training:add"]
    completions = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert any(m.get("role") == "tool" for c in completions for m in c["completion"])


class Counter:
    """An environment: it counts the adds the model made; its reward is 1 when it was used exactly once."""

    instances = []

    def __init__(self):
        self.calls, self.row = 0, None
        Counter.instances.append(self)

    def reset(self, **row):
        self.row = row
        return None

    def add(self, a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: the first number
            b: the second number
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return 1.0 if self.calls == 1 else 0.0


def test_environment_factory_resets_per_completion_and_adds_its_reward(caller_dir, tmp_path):
    Counter.instances.clear()
    seen = []

    def sees_environments(prompts, completions, environments, **_):
        seen.append(environments)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(caller_dir, [sees_environments], rows(), args=config(tmp_path),
                          environment_factory=Counter)
    batch = trainer.sample(trainer.next_prompts())
    trainer.score(batch)
    environments = batch.environments
    assert len(environments) == len(batch.rows) and len({id(e) for e in environments}) == len(environments)
    assert [e.row["solution"] for e in environments] == [r["solution"] for r in batch.rows]
    assert seen[-1] == environments
    calls = torch.tensor([float(e.calls) for e in environments])
    assert calls.sum() > 0, "the model called none of the environments' tools"
    assert torch.equal(batch.rewards.float(), (calls == 1).float())  # the reward is get_reward's alone


def test_tool_settings_without_tools_are_refused(caller_dir, tmp_path):
    with pytest.raises(CohortError, match="max_tool_calling_iterations=2 but the run has no tools"):
        GRPOTrainer(caller_dir, [answer_reward], rows(), args=config(tmp_path, max_tool_calling_iterations=2))
