"""On-policy distillation: the per-token advantage against an independent float64 computation, the teacher's
log-probs against a plain forward, a CLI run that logs distillation/reverse_kl, the refusals, and a student that
moves towards its teacher."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.algorithm.distillation import distillation_advantages, reverse_kl_mean, with_token_advantages
from cohort_grpo.cli import main
from cohort_grpo.errors import CohortError
from cohort_grpo.models import ModelConfig
from cohort_grpo.models.tiny import build_model, build_tokenizer, build_tools_tokenizer
from cohort_grpo.plans.training_plan import StepShape, training_memory_plan

SPEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)
TEACHER_SPEC = {**SPEC, "hidden_size": 48}
REPO = Path(__file__).resolve().parents[1]


def save_model(path: Path, spec=SPEC, seed: int = 0, tokenizer=None) -> Path:
    tokenizer = tokenizer or build_tokenizer()
    build_model(tokenizer, seed=seed, spec=spec).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distillation")
    save_model(root / "student")
    save_model(root / "teacher", spec=TEACHER_SPEC, seed=1)
    save_model(root / "tools-teacher", tokenizer=build_tools_tokenizer())
    return root


# ---- the maths, in float64 against a plain loop ------------------------------------------------------------

def reference_advantages(student, teacher, mask, coef, gamma):
    """Σ over the later sampled tokens k of γ^(number of sampled tokens between) · −coef·(s_k − t_k), by loops."""
    out = []
    for s_row, t_row, m_row in zip(student.tolist(), teacher.tolist(), mask.tolist()):
        sampled = [i for i, m in enumerate(m_row) if m]
        row = [0.0] * len(m_row)
        for n, i in enumerate(sampled):
            row[i] = sum(gamma ** (later - n) * -coef * (s_row[k] - t_row[k])
                         for later, k in enumerate(sampled) if later >= n)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("gamma", [0.0, 0.7, 1.0])
def test_distillation_advantage_matches_a_float64_loop(gamma):
    generator = torch.Generator().manual_seed(0)
    student = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4
    teacher = -torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1]])  # row 1: a tool result, then padding
    got = distillation_advantages(student, teacher, mask, coef=0.5, discount=gamma)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference_advantages(student, teacher, mask, 0.5, gamma), rtol=0, atol=1e-12)
    assert bool((got[mask == 0] == 0).all())


def test_worked_examples_of_the_docstrings():
    student, teacher = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-0.5, -3.0, -0.5]])
    ones = torch.ones(1, 3)
    assert distillation_advantages(student, teacher, ones, 1.0).tolist() == [[0.5, -1.0, 0.0]]
    assert distillation_advantages(student, teacher, ones, 1.0, 0.5).tolist() == [[0.0, -1.0, 0.0]]
    assert distillation_advantages(student, teacher, torch.tensor([[1, 0, 1]]), 1.0, 0.5).tolist() == [[0.5, 0, 0]]
    assert float(reverse_kl_mean(student[:, :2], teacher[:, :2], ones[:, :2])) == pytest.approx(0.25)
    combined = with_token_advantages(torch.tensor([1.0, -1.0]), torch.tensor([[0.5, 0.0], [0.0, 0.25]]))
    assert combined.tolist() == [[1.5, 1.0], [-1.0, -0.75]]


def test_the_memory_plan_counts_the_teacher(models):
    """The teacher's weights, read from its config.json before loading, are a term of every phase of the plan."""
    from transformers import AutoModelForCausalLM

    from cohort_grpo.plans.capacity import teacher_bytes

    args = GRPOConfig(teacher_model=str(models / "teacher"), distillation_coef=1.0, dtype="float32")
    loaded = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(models / "teacher").parameters())
    assert teacher_bytes(args) == 4 * loaded
    assert teacher_bytes(GRPOConfig(teacher_model=str(models / "teacher"), distillation_coef=1.0,
                                    teacher_model_init_kwargs={"dtype": "bfloat16"})) == 2 * loaded
    config = ModelConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    step = StepShape(rows=8, group=4, prompt_len=16, completion_len=16, micro_rows=8)
    alone, with_teacher = (training_memory_plan(config, replace(step, teacher_bytes=n)) for n in (0, 12345))
    for phase in alone.phases:
        assert with_teacher.total(phase) - alone.total(phase) == 12345, phase


# ---- the trainer ---------------------------------------------------------------------------------------------

def rows(size: int = 32) -> list[dict]:
    from cohort_grpo.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask().load("train", levels=[2], size=size)


def small_args(out: Path, **overrides) -> GRPOConfig:
    options = dict(output_dir=str(out), num_generations=4, per_device_train_batch_size=8,
                   gradient_accumulation_steps=1, max_completion_length=6, max_prompt_length=64, max_steps=1,
                   eval_limit=0, learning_rate=1e-3, quiet=True, device="cpu", save_strategy="no")
    return GRPOConfig(**{**options, **overrides})


def test_teacher_logprobs_are_a_plain_forwards(models, tmp_path):
    """The teacher's log π of each sampled token from the fused head equals log_softmax of its own logits, and the
    step's metrics are their means over the sampled tokens."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    teacher = AutoModelForCausalLM.from_pretrained(models / "teacher")
    trainer = GRPOTrainer(str(models / "student"), [], rows(), args=small_args(
        tmp_path / "run", distillation_coef=1.0, teacher_model=str(models / "teacher")),
                          processing_class=tokenizer)
    batch = trainer.rollouts.take(1)
    trainer.score(batch)
    batch.advantages = trainer.estimate_advantages(batch)
    assert float(batch.advantages.abs().max()) == 0  # no reward functions: the teacher's term is all there is
    advantages, metrics = trainer.distil(batch)
    mask = batch.rollout.loss_mask.bool()
    student_logp, teacher_logp = [], []
    for prompt, ids, row_mask in zip(batch.prompt_ids, batch.rollout.completion_ids, mask):
        tokens = ids[row_mask].tolist()
        full = torch.tensor([prompt + tokens])
        for model, into in ((trainer.model, student_logp), (teacher, teacher_logp)):
            with torch.no_grad():
                logits = model(full).logits if model is teacher else model(full)
                logits = getattr(logits, "logits", logits)
            logp = torch.log_softmax(logits[0, len(prompt) - 1:-1].double(), dim=-1)
            into.append(logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1))
    student_logp, teacher_logp = torch.cat(student_logp), torch.cat(teacher_logp)
    assert metrics["distillation/teacher_logp"] == pytest.approx(float(teacher_logp.mean()), abs=1e-5)
    assert metrics["distillation/reverse_kl"] == pytest.approx(float((student_logp - teacher_logp).mean()), abs=1e-5)
    torch.testing.assert_close(advantages[mask].double(), teacher_logp - student_logp, atol=1e-5, rtol=0)


def cli_train(models: Path, out: Path, cwd: Path, *extra: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cohort_grpo", "train", "--model", str(models / "student"), "--teacher_model",
         str(models / "teacher"), "--distillation_coef", "1", "--num_generations", "4",
         "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--max_completion_length", "6",
         "--max_prompt_length", "64", "--eval_limit", "2", "--logging_steps", "1", "--device", "cpu", "--quiet",
         "--output_dir", str(out), *extra], capture_output=True, text=True, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_cli_train_with_a_teacher_logs_the_reverse_kl_and_resumes(models, tmp_path):
    """`cohort-grpo train --teacher_model ... --max_steps 3`, stopped after step 2 and resumed: the teacher is in no
    checkpoint, and the resumed run loads it again from the config."""
    out = tmp_path / "run"
    cli_train(models, out, tmp_path, "--max_steps", "2", "--save_steps", "1")
    assert (out / "checkpoint-2").is_dir()
    saved = {path.name for path in (out / "checkpoint-2").rglob("*")}
    assert not any("teacher" in name for name in saved), saved
    cli_train(models, out, tmp_path, "--max_steps", "3", "--resume")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        assert math.isfinite(record["distillation/reverse_kl"]) and record["distillation/teacher_logp"] < 0


def test_asynchronous_rollouts_are_distilled_too(models, tmp_path):
    trainer = GRPOTrainer(str(models / "student"), [], rows(), processing_class=build_tokenizer(),
                          args=small_args(tmp_path / "run", distillation_coef=1.0, teacher_model=str(models / "teacher"),
                                          async_rollouts=True, max_steps=2), log=lambda *_: None)
    trainer.train()
    assert [math.isfinite(r["distillation/reverse_kl"]) for r in trainer.history] == [True, True]


def test_teachers_served_by_transformers_modules_and_vision_language_teachers_train(models, tmp_path):
    """A teacher of a family cohort does not implement (OLMo 2: transformers' own modules, the generic path) and a
    vision-language teacher of a vision-language student, each two steps with the log of a real run (loading such a
    teacher logs which path serves it, while the run is still being built)."""
    from cohort_grpo.models.tiny_vision import build_vision_model, build_vision_processor
    from cohort_grpo.tasks.shapes import ShapesTask
    from test_generic_models import save_folder

    lines: list[str] = []
    olmo = save_folder("olmo2", tmp_path / "olmo2-teacher")  # the built-in tokenizer's vocabulary, as the student's
    text = GRPOTrainer(str(models / "student"), [], rows(), processing_class=build_tokenizer(), log=lines.append,
                       args=small_args(tmp_path / "text", distillation_coef=1.0, teacher_model=olmo, max_steps=2))
    text.train()
    assert type(text.teacher.model).__name__ == "TransformersCausalLM"
    assert [r["distillation/reverse_kl"] != 0 and r["distillation/teacher_logp"] < 0 for r in text.history] == [True] * 2

    processor = build_vision_processor()
    teacher = tmp_path / "vision-teacher"
    build_vision_model(processor.tokenizer, seed=1).save_pretrained(teacher)  # the student's shape, other weights
    processor.save_pretrained(teacher)
    task = ShapesTask()
    vision = GRPOTrainer("cohort:tiny-vision", task.reward_funcs, task.load("train", size=16), task=task,
                         log=lines.append, args=small_args(tmp_path / "vision", distillation_coef=1.0, max_steps=2,
                                                           teacher_model=str(teacher), max_prompt_length=128))
    vision.train()
    assert [r["distillation/reverse_kl"] != 0 and r["distillation/teacher_logp"] < 0
            for r in vision.history] == [True] * 2
    assert any("vision-language path" in line for line in lines)


# ---- refusals, one line each -----------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, expected", [
    (["--distillation_coef", "-1"], "distillation_coef=-1.0 is negative"),
    (["--distillation_coef", "1", "--distillation_discount", "1.5"], "distillation_discount=1.5 must lie in [0, 1]"),
    (["--teacher_model", "{teacher}"], "distillation_coef=0.0: a teacher_model is given and would never be used"),
    (["--distillation_coef", "1"], "distillation_coef=1.0: there is no teacher to distil from"),
    (["--teacher_model", "{tools}", "--distillation_coef", "1"], "has another vocabulary than the policy's"),
    (["--teacher_model", "{teacher}", "--distillation_coef", "1", "--teacher_model_init_kwargs",
      '{"attn_implementation": "sdpa"}'], "cohort takes only dtype there"),
])
def test_refusals_are_one_line(models, tmp_path, capsys, monkeypatch, extra, expected):
    monkeypatch.chdir(tmp_path)
    extra = [e.replace("{teacher}", str(models / "teacher")).replace("{tools}", str(models / "tools-teacher"))
             for e in extra]
    code = main(["train", "--model", str(models / "student"), "--max_steps", "1", "--device", "cpu", "--quiet",
                 "--output_dir", str(tmp_path / "run"), *extra])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cohort: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert expected in errors[0]


def test_trl_names_map_onto_teacher_model():
    args = GRPOConfig(teacher_model_name_or_path="some/teacher", distillation_coef=1.0,
                      teacher_model_init_kwargs={"torch_dtype": "bfloat16"}).validate()
    assert (args.teacher_model, args.teacher_model_name_or_path) == ("some/teacher", None)
    from cohort_grpo.run.teacher import teacher_dtype

    assert teacher_dtype(args, torch.device("cpu")) == "bfloat16"


def test_a_teacher_object_with_its_own_vocabulary_is_refused(tmp_path, models):
    small = build_model(build_tools_tokenizer(), seed=0, spec=SPEC)
    small.resize_token_embeddings(10)
    with pytest.raises(CohortError, match="teacher_model's LM head has 10 rows"):
        GRPOTrainer(str(models / "student"), [], rows(), args=small_args(tmp_path / "run", distillation_coef=1.0),
                    processing_class=build_tokenizer(), teacher_model=small)


# ---- the student moves towards its teacher -------------------------------------------------------------------

@pytest.mark.cpu("a CPU run's numbers: the reverse KL of a fixed seed's steps")
def test_the_student_approaches_its_teacher(models, tmp_path):
    """Pure on-policy distillation (no reward functions) of a random student towards a teacher that a short
    supervised pass taught the arithmetic answer format: the per-token reverse KL on the student's own samples
    falls (about 4.4 → 2.9 in 30 steps)."""
    from cohort_grpo.sft.sft_config import SFTConfig
    from cohort_grpo.sft.sft_trainer import sft_train
    from cohort_grpo.tasks.arithmetic import ArithmeticTask

    torch.set_num_threads(1)
    tokenizer, task = build_tokenizer(), ArithmeticTask()
    teacher = build_model(tokenizer, seed=1, spec=TEACHER_SPEC)
    solved = [{"prompt": r["prompt"], "completion": task.solved_completion(r)} for r in rows(500)]
    sft_train(teacher, tokenizer, solved, SFTConfig(learning_rate=3e-3, max_steps=150, batch_size=32, warmup_steps=5),
              log=lambda *_: None)
    args = small_args(tmp_path / "run", distillation_coef=1.0, max_steps=30, learning_rate=1e-2,
                      per_device_train_batch_size=16, max_completion_length=8)
    trainer = GRPOTrainer(str(models / "student"), [], rows(64), args=args, processing_class=tokenizer,
                          teacher_model=teacher, log=lambda *_: None)
    trainer.train()
    kl = [record["distillation/reverse_kl"] for record in trainer.history]
    assert sum(kl[-5:]) / 5 < 0.8 * sum(kl[:5]) / 5, kl
