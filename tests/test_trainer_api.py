"""The transformers `Trainer` API a TRL script calls, on the tiny model: train(resume_from_checkpoint=...) and its
`TrainOutput`, evaluate() on eval_dataset with the script's own reward functions, save_state / log_metrics /
save_metrics / is_world_process_zero against transformers' own implementations, and push_to_hub against a local
fake of the Hub's HTTP endpoints (never the network)."""

from __future__ import annotations

import base64
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerState
from transformers.trainer_pt_utils import log_metrics as transformers_log_metrics
from transformers.trainer_pt_utils import save_metrics as transformers_save_metrics
from transformers.trainer_utils import TrainOutput

from cohort_grpo import GRPOConfig, GRPOTrainer
from cohort_grpo.errors import CohortError

PROMPTS = [{"prompt": f"{a}+{b}="} for a in range(1, 5) for b in range(1, 3)]
EVAL_PROMPTS = [{"prompt": f"{a}*2="} for a in range(1, 4)]


def first_is_digit(prompts, completions, **_):
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def args_for(out, **overrides) -> GRPOConfig:
    base = dict(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                max_completion_length=4, max_steps=3, learning_rate=1e-3, output_dir=str(out), quiet=True, seed=0,
                beta=0.0)
    return GRPOConfig(**{**base, **overrides})


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


# ---- train(resume_from_checkpoint=...) ---------------------------------------------------------------------

def test_train_resumes_as_transformers_says_after_the_trainer_was_built(tiny_dir, tmp_path):
    out = tmp_path / "run"
    whole = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args_for(out, save_steps=1, save_total_limit=0))
    whole.train()
    uninterrupted = [dict(r) for r in whole.history]
    for folder in ("checkpoint-3", "checkpoint-2"):  # as a run killed after step 1 leaves its folder
        shutil.rmtree(out / folder)

    lines = []
    args = args_for(out, save_steps=1, save_total_limit=0)
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args, log=lines.append)
    with pytest.raises(CohortError, match="holds an unfinished run"):  # built fine; train() refuses a fresh start
        trainer.train()
    trainer.train(resume_from_checkpoint=True)  # the same trainer: the newest checkpoint in output_dir
    assert any(f"resumed from {out / 'checkpoint-1'} at step 1" in line for line in lines), lines
    assert [r["step"] for r in trainer.history] == [1, 2, 3]
    for mine, theirs in zip(trainer.history[1:], uninterrupted[1:]):  # exact resume: the same steps 2 and 3
        assert (mine["loss"], mine["reward"]) == (theirs["loss"], theirs["reward"])

    named = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args, log=lines.append)
    named.train(resume_from_checkpoint=str(out / "checkpoint-2"))  # a path: that very checkpoint
    assert any(f"resumed from {out / 'checkpoint-2'} at step 2" in line for line in lines)
    assert named.history[-1]["loss"] == uninterrupted[-1]["loss"]

    with pytest.raises(CohortError, match="cannot resume from .*checkpoint-9: it is missing"):
        named.train(resume_from_checkpoint=str(out / "checkpoint-9"))


def test_train_returns_transformers_train_output(tiny_dir, tmp_path):
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args_for(tmp_path))
    result = trainer.train()
    assert isinstance(result, TrainOutput)
    losses = [r["loss"] for r in trainer.history]
    assert result.global_step == 3 == trainer.state.global_step
    assert result.training_loss == pytest.approx(sum(losses) / 3, abs=1e-12)
    metrics = result.metrics
    assert set(metrics) == {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss",
                            "epoch"}
    assert metrics["train_loss"] == result.training_loss
    assert metrics["train_steps_per_second"] == pytest.approx(3 / metrics["train_runtime"], rel=1e-2)
    assert metrics["train_samples_per_second"] == pytest.approx(3 * 4 / metrics["train_runtime"], rel=1e-2)
    assert metrics["epoch"] == pytest.approx(3 * 2 / len(PROMPTS))  # 2 prompts a step, 8 rows


# ---- evaluate() with the script's reward functions ---------------------------------------------------------

class Recorder:
    """A reward function that keeps what it scored: the expected metrics are computed from its calls."""

    __name__ = "length_reward"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, **_):
        scores = [float(len(c)) for c in completions]
        self.calls.append((list(prompts), scores))
        return scores


def test_evaluate_samples_eval_dataset_and_scores_it_with_the_users_rewards(tiny_dir, tmp_path):
    reward = Recorder()
    trainer = GRPOTrainer(tiny_dir, reward, PROMPTS, args=args_for(tmp_path, max_steps=1), eval_dataset=EVAL_PROMPTS)
    before = len(reward.calls)
    metrics = trainer.evaluate()
    (prompts, scores), = reward.calls[before:]  # one call, every held-out completion
    assert sorted(set(prompts)) == sorted(r["prompt"] for r in EVAL_PROMPTS)
    assert len(scores) == len(EVAL_PROMPTS) * 2  # G = num_generations completions each, as TRL's default
    groups = torch.tensor(scores).view(-1, 2)
    assert metrics["eval_reward"] == pytest.approx(sum(scores) / len(scores))
    assert metrics["eval_rewards/length_reward/mean"] == pytest.approx(sum(scores) / len(scores))
    assert metrics["eval_reward_std"] == pytest.approx(float(groups.std(dim=1).mean()))
    assert metrics["eval_frac_reward_zero_std"] == pytest.approx(float((groups.std(dim=1) == 0).float().mean()))
    assert 0 < metrics["eval_completions/mean_length"] <= 4
    assert trainer.state.log_history[-1] == {**metrics, "step": 0}


def test_evaluation_runs_at_eval_steps_and_leaves_the_training_numbers_alone(tiny_dir, tmp_path):
    plain = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args_for(tmp_path / "plain"))
    plain.train()
    seen = []

    class OnEvaluate:
        def on_evaluate(self, args, state, control, metrics=None, **_):
            seen.append((state.global_step, metrics))

    evaluated = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args_for(tmp_path / "eval", eval_steps=1),
                            eval_dataset=EVAL_PROMPTS, callbacks=[OnEvaluate()])
    evaluated.train()
    assert [step for step, _ in seen] == [1, 2, 3]  # every eval_steps, the last step's too (transformers)
    assert all({"eval_reward", "eval_rewards/first_is_digit/mean"} <= set(m) for _, m in seen)
    logged = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "eval_reward" in r] == [1, 2, 3]
    for mine, theirs in zip(evaluated.history, plain.history):  # the run's data order and sampling seeds are kept
        assert (mine["loss"], mine["reward"]) == (theirs["loss"], theirs["reward"])
    after = evaluated.evaluate()  # once train() returned, as a TRL script calls it
    assert {"eval_reward", "eval_reward_std"} <= set(after) and evaluated.state.log_history[-1]["step"] == 3


# ---- results files, state, rank --------------------------------------------------------------------------

def test_results_and_state_files_match_transformers(tiny_dir, tmp_path, capsys):
    out, reference = tmp_path / "run", tmp_path / "transformers"
    reference.mkdir()
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args_for(out, max_steps=2))
    metrics = trainer.train().metrics
    assert trainer.is_world_process_zero()
    theirs = SimpleNamespace(is_world_process_zero=lambda: True, args=SimpleNamespace(output_dir=str(reference)))

    capsys.readouterr()
    transformers_log_metrics(theirs, "train", metrics)
    expected = capsys.readouterr().out
    trainer.log_metrics("train", metrics)
    assert capsys.readouterr().out == expected and expected.startswith("***** train metrics *****\n")

    for split, values in (("train", metrics), ("eval", {"eval_reward": 0.5, "train_loss": 9.0})):
        trainer.save_metrics(split, values)
        transformers_save_metrics(theirs, split, values)
    for name in ("train_results.json", "eval_results.json", "all_results.json"):
        assert json.loads((out / name).read_text()) == json.loads((reference / name).read_text()), name
    assert json.loads((out / "all_results.json").read_text())["train_loss"] == 9.0  # merged, the later one wins

    trainer.save_state()
    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 2 and state.max_steps == 2
    assert [r["step"] for r in state.log_history] == [1, 2]


# ---- push_to_hub ---------------------------------------------------------------------------------------------

class FakeHub(BaseHTTPRequestHandler):
    """The Hub's create-repo, preupload and commit endpoints, answering as the Hub does for small files."""

    received: dict = {}

    def log_message(self, *args):  # quiet
        pass

    def reply(self, body: dict, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        endpoint = f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"
        self.received.setdefault("auth", self.headers.get("Authorization"))
        if self.path == "/api/repos/create":
            payload = json.loads(body)
            self.received["create"] = payload
            return self.reply({"url": f"{endpoint}/{payload.get('organization') or 'someone'}/{payload['name']}"})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self.reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        if "/commit/" in self.path:
            self.received["commit_path"] = self.path
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            self.received["header"] = next(line["value"] for line in lines if line["key"] == "header")
            self.received["files"] = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                                      for line in lines if line["key"] == "file"}
            repo = self.path.split("/api/models/", 1)[1].split("/commit/", 1)[0]
            return self.reply({"commitUrl": f"{endpoint}/{repo}/commit/1234", "commitOid": "1234" * 10,
                               "pullRequestUrl": None})
        self.reply({"error": f"unexpected {self.path}"}, 404)


@pytest.fixture
def fake_hub(monkeypatch):
    FakeHub.received = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    yield FakeHub.received
    server.shutdown()
    server.server_close()


def test_push_to_hub_uploads_the_trained_policy_to_the_repository(tiny_dir, tmp_path, fake_hub):
    out = tmp_path / "my-run"
    args = args_for(out, max_steps=1, hub_model_id="me/tiny-grpo", hub_token="hf_fake", hub_private_repo=True)
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, args=args)
    trainer.train()
    info = trainer.push_to_hub(commit_message="tiny run")
    assert info.commit_url.endswith("/commit/1234")
    assert fake_hub["create"]["name"] == "tiny-grpo" and fake_hub["create"]["organization"] == "me"
    assert fake_hub["create"].get("visibility") == "private" or fake_hub["create"].get("private") is True
    assert fake_hub["auth"] == "Bearer hf_fake"
    assert fake_hub["commit_path"].startswith("/api/models/me/tiny-grpo/commit/main")
    assert fake_hub["header"]["summary"] == "tiny run"
    files = fake_hub["files"]
    assert files["config.json"] == (out / "config.json").read_bytes()
    weights = [name for name in files if name.endswith(".safetensors") or name.endswith(".bin")]
    assert weights and all(files[name] == (out / name).read_bytes() for name in weights)
    assert "summary.json" in files and "metrics.jsonl" in files
    assert not any(name.startswith("checkpoint-") for name in files)  # the checkpoints stay local


def test_push_to_hub_true_pushes_when_training_ends(tiny_dir, tmp_path, fake_hub):
    out = tmp_path / "my-run"
    lines = []
    trainer = GRPOTrainer(tiny_dir, first_is_digit, PROMPTS, log=lines.append,
                          args=args_for(out, max_steps=1, push_to_hub=True, hub_token="hf_fake"))
    trainer.train()
    assert fake_hub["create"]["name"] == "my-run"  # output_dir's name where hub_model_id is None
    assert fake_hub["header"]["summary"] == "End of training"
    assert fake_hub["files"]["summary.json"] == (out / "summary.json").read_bytes()


def test_hub_model_id_is_checked_when_the_config_is_written():
    with pytest.raises(CohortError, match="hub_model_id='me/two words' is not a Hub repository id"):
        GRPOConfig(hub_model_id="me/two words")
