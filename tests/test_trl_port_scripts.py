"""TRL GRPO scripts ported by their import alone: what a TRL 1.16 script passes its reward functions, its callbacks and
its config means the same here, or is refused in one line naming the option and the fix.

Each run is two steps of the built-in tiny model on CPU; the learning-rate schedule is checked against transformers'
own `get_scheduler`, which TRL's trainer uses."""

import asyncio
import json

import pytest
import torch
from transformers import TrainerCallback, get_scheduler

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError
from cohort_grpo.update.schedule import lr_scheduler

ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]


def small(tmp_path, **overrides) -> GRPOConfig:
    options = dict(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4,
                   gradient_accumulation_steps=1, max_completion_length=4, max_steps=2, learning_rate=1e-4,
                   report_to="none", quiet=True, save_strategy="no")
    return GRPOConfig(**{**options, **overrides})


def length(completions, **_):
    return [float(len(c)) for c in completions]


# ---- what a reward function is given ---------------------------------------------------------------

def test_reward_functions_get_trls_trainer_state_and_log_metric(tiny_dir, tmp_path):
    """TRL passes `trainer_state` (transformers' TrainerState: global_step is the steps completed before this one)
    and `log_metric(name, value)` (a scalar reported with the step's metrics) to every reward function."""
    seen = []

    def by_step(completions, trainer_state, **kwargs):
        seen.append(trainer_state.global_step)
        kwargs["log_metric"]("my/steps_done", float(trainer_state.global_step) + 0.5)
        return [float(trainer_state.global_step)] * len(completions)

    trainer = GRPOTrainer(tiny_dir, reward_funcs=[length, by_step], train_dataset=ROWS, args=small(tmp_path))
    trainer.train()
    assert seen == [0, 1]
    assert [r["rewards/by_step/mean"] for r in trainer.history] == [0.0, 1.0]
    assert [r["my/steps_done"] for r in trainer.history] == [0.5, 1.5]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["my/steps_done"] for r in logged if "loss" in r] == [0.5, 1.5]


def test_an_async_reward_function_is_awaited(tiny_dir, tmp_path):
    async def answer_length(completions, answer, **_):
        await asyncio.sleep(0)
        return [float(len(c) + len(a)) for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(tiny_dir, reward_funcs=[length, answer_length], train_dataset=ROWS, args=small(tmp_path))
    trainer.train()
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    for sample in samples:
        row = next(r for r in ROWS if r["prompt"] == sample["prompt"])
        assert sample["rewards"]["answer_length"] == len(sample["completion"]) + len(row["answer"])


def test_log_extra_columns_reach_each_completions_line(tiny_dir, tmp_path, capsys):
    """TRL's log_extra(column, values): one value per completion, shown beside it in completions.jsonl; a call with
    the wrong count is a notice, and the run goes on."""
    def judged(completions, log_extra, **_):
        log_extra("verdict", [f"{len(c)} chars" for c in completions])
        log_extra("short", ["x"])  # one value for the whole batch: not a column
        return [0.0] * len(completions)

    trainer = GRPOTrainer(tiny_dir, reward_funcs=[length, judged], train_dataset=ROWS, args=small(tmp_path))
    trainer.train()
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert samples and all(sample["verdict"] == f"{len(sample['completion'])} chars" for sample in samples)
    assert not any("short" in sample for sample in samples)
    notice = capsys.readouterr().err
    assert "log_extra('short', ...) with 1 values for 4 completions; pass one per completion" in notice


# ---- callbacks --------------------------------------------------------------------------------------

def test_on_log_sees_the_step_it_logs(tiny_dir, tmp_path):
    """transformers' Trainer counts a step in state.global_step before it logs it."""
    class Steps(TrainerCallback):
        logged = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append((state.global_step, logs["step"]))

    GRPOTrainer(tiny_dir, reward_funcs=length, train_dataset=ROWS, args=small(tmp_path), callbacks=[Steps()]).train()
    assert Steps.logged == [(1, 1), (2, 2)]


def test_callbacks_hear_a_step_in_transformers_order(tiny_dir, tmp_path):
    """transformers' Trainer calls on_step_end, then on_log (when logging_steps says, or when a callback set
    control.should_log in on_step_end), then evaluates and saves."""
    class Events(TrainerCallback):
        heard = []

        def on_step_end(self, args, state, control, **kwargs):
            self.heard.append(("step_end", state.global_step))
            control.should_log = state.global_step == 1  # a step logging_steps would not log

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.heard.append(("log", logs["step"]))

        def on_save(self, args, state, control, **kwargs):
            self.heard.append(("save", state.global_step))

    args = small(tmp_path, max_steps=3, logging_steps=2, save_strategy="steps", save_steps=1)
    GRPOTrainer(tiny_dir, reward_funcs=length, train_dataset=ROWS, args=args, callbacks=[Events()]).train()
    assert Events.heard == [("step_end", 1), ("log", 1), ("save", 1), ("step_end", 2), ("log", 2), ("save", 2),
                            ("step_end", 3), ("log", 3), ("save", 3)]


# ---- the learning-rate schedule ---------------------------------------------------------------------

def factors(scheduler, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(round(optimizer.param_groups[0]["lr"], 6))
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("iterations", [1, 2])
def test_the_schedule_is_transformers_over_every_update_of_the_run(kind, warmup, iterations):
    """μ updates per step: the schedule spans max_steps × μ optimizer steps (its warm-up warmup_steps × μ), as TRL's,
    where each of μ optimizer steps counts; it is transformers' formula, warm-up from 0 included."""
    args = GRPOConfig(max_steps=6, warmup_steps=warmup, lr_scheduler_type=kind, num_iterations=iterations,
                      output_dir="unused")
    updates = 6 * iterations
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    expected = factors(get_scheduler(kind, theirs, num_warmup_steps=warmup * iterations, num_training_steps=updates),
                       theirs, updates)
    assert factors(lr_scheduler(ours, args), ours, updates) == expected
    assert expected[-1] > 0  # the last update still learns


# ---- config values that ask for what cohort does ----------------------------------------------------

def test_steps_per_generation_and_generation_batch_size_at_what_cohort_does_are_accepted():
    config = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=2,
                        generation_batch_size=16, num_generations=4, output_dir="unused")
    assert config.generation_batch_size == 16
    with pytest.raises(CohortError, match=r"^cohort cannot honour GRPOConfig\(steps_per_generation=4\).*"
                                          r"gradient_accumulation_steps"):
        GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4)
    with pytest.raises(CohortError, match=r"^cohort cannot honour GRPOConfig\(generation_batch_size=32\)"):
        GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, generation_batch_size=32)


def test_top_k_none_is_off_as_in_trl():
    assert GRPOConfig(top_k=None, output_dir="unused").top_k == 0


# ---- GRPOTrainer's TRL keywords ---------------------------------------------------------------------

@pytest.mark.parametrize("keyword, value, words", [
    ("optimizers", (object(), None), "optimizers"),
    ("quantization_config", object(), "quantization_config"),
    ("rollout_func", lambda *a, **k: None, "rollout_func"),
])
def test_trl_trainer_keywords_cohort_cannot_honour_are_one_line_errors(tiny_dir, tmp_path, keyword, value, words):
    with pytest.raises(CohortError, match=words) as error:
        GRPOTrainer(tiny_dir, reward_funcs=length, train_dataset=ROWS, args=small(tmp_path), **{keyword: value})
    assert "\n" not in str(error.value)


def test_trl_trainer_keywords_at_their_defaults_are_accepted(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, reward_funcs=length, train_dataset=ROWS, args=small(tmp_path),
                          optimizers=(None, None), quantization_config=None, rollout_func=None,
                          reward_processing_classes=None)
    assert trainer.args.max_steps == 2


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_dir):
    """A one-layer sequence classifier on the tiny model's tokenizer, saved as a folder named like a hub model."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "tiny-rm"
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def trl_reward_model_scores(model, tokenizer, prompts, completions) -> list[float]:
    """TRL 1.16's scoring of plain-text prompts by a sequence classifier: prompt + completion, right-padded, no
    special tokens added, the first logit."""
    inputs = tokenizer(text=[p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True,
                       padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].tolist()


def test_a_reward_model_module_reads_its_reward_processing_class(tiny_dir, tmp_path, reward_model):
    """TRL's reward_processing_classes: the tokenizer each reward model reads; the metrics name the model as TRL
    does (its folder's last name)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(reward_model, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    trainer = GRPOTrainer(tiny_dir, reward_funcs=[length, model], train_dataset=ROWS, args=small(tmp_path, max_steps=1),
                          reward_processing_classes=[None, tokenizer])
    trainer.train()
    assert "rewards/tiny-rm/mean" in trainer.history[0]
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    expected = trl_reward_model_scores(model, tokenizer, [s["prompt"] for s in samples],
                                       [s["completion"] for s in samples])
    assert [s["rewards"]["tiny-rm"] for s in samples] == pytest.approx(expected, abs=1e-5)


def test_a_reward_model_folder_is_named_as_trl_names_it(tiny_dir, tmp_path, reward_model):
    trainer = GRPOTrainer(tiny_dir, reward_funcs=[length, str(reward_model)], train_dataset=ROWS,
                          args=small(tmp_path, max_steps=1))
    assert trainer.rewards.names == ["length", "tiny-rm"]


def test_reward_processing_classes_of_the_wrong_length_are_refused(tiny_dir, tmp_path):
    with pytest.raises(CohortError, match="reward_processing_classes"):
        GRPOTrainer(tiny_dir, reward_funcs=[length], train_dataset=ROWS, args=small(tmp_path),
                    reward_processing_classes=[None, None])


def test_trls_positional_order_trains_as_the_keyword_call(tiny_dir, tmp_path):
    """TRL's signature is (model, reward_funcs, args, train_dataset): a script that passes them by position trains
    the same run as cohort's keyword call."""
    by_position = GRPOTrainer(tiny_dir, length, small(tmp_path / "a"), ROWS)
    by_position.train()
    by_keyword = GRPOTrainer(tiny_dir, reward_funcs=length, train_dataset=ROWS, args=small(tmp_path / "b"))
    by_keyword.train()
    assert str(by_position.args.output_dir).endswith("a")
    assert [r["loss"] for r in by_position.history] == [r["loss"] for r in by_keyword.history]
    assert [r["reward"] for r in by_position.history] == [r["reward"] for r in by_keyword.history]
