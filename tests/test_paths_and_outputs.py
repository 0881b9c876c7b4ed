"""Where models come from and where results go: a mistyped local model path is one line naming the
folder (never a hub error), a hub that cannot be reached fails at once in one line (models and
datasets), and `cohort-grpo eval` writes beside a model cohort wrote (a run, a checkpoint, an SFT output), so
two runs never overwrite each other's results, and under runs/eval/ for any other (never into a downloaded folder)."""

import http.server
import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from cohort_grpo.cli import main
from cohort_grpo.errors import CohortError
from cohort_grpo.models import loading
from cohort_grpo.models.loading import from_pretrained, hub_unreachable, is_hub_id, looks_local

CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding runs/arithmetic and runs/cohort, as after two training runs."""
    for name in ("arithmetic", "cohort"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def dead_hub(monkeypatch):
    """The hub endpoint is a closed local port; no proxy in between; nothing remembered from before."""
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "*")
    monkeypatch.setenv("no_proxy", "*")
    monkeypatch.setattr(loading, "_PROBES", {})


def no_hub(*_, **__):
    raise AssertionError("the hub was asked about a local path")


# ---- local path or hub id -----------------------------------------------------------------------

@pytest.mark.parametrize("spec, local, hub", [
    ("runs/nope", True, False),  # runs/ is a folder here: a local path, though shaped like org/name
    ("org/name", False, True),
    ("Qwen/Qwen2.5-0.5B-Instruct", False, True),
    ("./nope", True, False), ("../nope", True, False), ("/abs/model", True, False), ("~/x/y", True, False),
    ("runs/arithmetic/checkpoint-9", True, False),  # more than one slash
    ("a/b/c", True, False), ("model.gguf", True, False), ("org/model.safetensors", True, False),
    ("runs\\nope", True, False), ("org/na me", True, False),  # not a valid hub id
    ("nope", False, False),  # a bare name: neither (the "no model at" message)
])
def test_local_path_or_hub_id(workdir, spec, local, hub):
    assert looks_local(spec) is local
    assert is_hub_id(spec) is hub


@pytest.mark.parametrize("command", ["train", "eval", "chat", "generate", "chat --model", "generate --model"])
def test_a_mistyped_local_path_is_one_line_naming_the_folder(workdir, command, capsys, monkeypatch):
    monkeypatch.setattr(loading, "hub_unreachable", no_hub)
    monkeypatch.setattr(loading, "_download", no_hub)
    (workdir / "prompts.txt").write_text("1+1=?\n")
    argv = {"train": ["train", "--model", "runs/nope"], "eval": ["eval", "--model", "runs/nope"],
            "chat": ["chat", "runs/nope"], "generate": ["generate", "runs/nope", "--prompts", "prompts.txt"],
            # chat and generate take the model as --model too, as train and eval name it
            "chat --model": ["chat", "--model", "runs/nope"],
            "generate --model": ["generate", "--model", "runs/nope", "--prompts", "prompts.txt"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cohort: error: model folder 'runs/nope' does not exist (runs/ has: arithmetic, cohort); "
                   "pass an existing folder or a hub id"]
    assert not (workdir / "runs" / "eval").exists()  # eval created no results folder for it


def test_the_model_given_twice_or_without_its_flag_is_one_line(workdir, capsys):
    (workdir / "prompts.txt").write_text("1+1=?\n")
    with pytest.raises(SystemExit):
        main(["generate", "runs/arithmetic", "--model", "runs/cohort", "--prompts", "prompts.txt"])
    assert ("the model is given twice ('runs/arithmetic' and --model 'runs/cohort'): give one"
            in capsys.readouterr().err)
    assert main(["eval", "runs/arithmetic"]) == 2  # eval names it --model: the line says so for an existing path
    assert capsys.readouterr().err.strip() == ("cohort: error: cohort eval: unexpected argument 'runs/arithmetic'; "
                                               "options look like --name value (a model: --model runs/arithmetic)")


@pytest.mark.parametrize("spec, fragment", [
    ("./nope", "model folder './nope' does not exist (./ has: runs)"),
    ("runs/cohortt", "(runs/ has: arithmetic, cohort); did you mean 'runs/cohort'? Else pass"),
    ("runs/cohort/checkpoint-4/",
     "model folder 'runs/cohort/checkpoint-4/' does not exist (runs/cohort/ has no subfolders)"),
    ("deep/er/model", "model folder 'deep/er/model' does not exist (the current folder has: runs)"),
    ("missing.gguf", "model file 'missing.gguf' does not exist (the current folder has: runs); pass an existing file"),
])
def test_the_message_names_the_nearest_existing_folder(workdir, spec, fragment, monkeypatch):
    monkeypatch.setattr(loading, "_download", no_hub)
    with pytest.raises(CohortError) as caught:
        from_pretrained(spec)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_an_unreachable_hub_fails_at_once_in_one_line(tmp_path, dead_hub, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)
    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    started = time.monotonic()
    assert main(["eval", "--model", "cohort-test/not-a-model", "--limit", "2"]) == 2
    assert time.monotonic() - started < 15
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "'cohort-test/not-a-model' is no local folder, not in the Hugging Face cache, and the hub cannot be " \
           f"reached to fetch it ({CLOSED_PORT}:" in err[0]
    assert calls == [True]  # the cache only: the hub itself was never tried (its client retries)


def test_offline_mode_is_named_and_never_probes(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loading, "hub_unreachable", no_hub)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CohortError, match="not in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        from_pretrained("cohort-test/not-a-model")


def test_any_http_answer_means_reachable(monkeypatch):
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *_):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(loading, "_PROBES", {})
        monkeypatch.setenv("NO_PROXY", "*")
        monkeypatch.setenv("no_proxy", "*")
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub_unreachable() is None
        monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
        assert hub_unreachable()  # the reason, e.g. "Connection refused"
    finally:
        server.shutdown()


# ---- hub datasets --------------------------------------------------------------------------------

def test_hub_dataset_with_an_unreachable_hub_tries_the_cache_once(dead_hub, monkeypatch):
    from cohort_grpo.tasks.data import load_hub_dataset

    seen = []

    def load_dataset(name, config, split):
        seen.append((name, config, split, fake.config.HF_HUB_OFFLINE))
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    fake = types.SimpleNamespace(config=types.SimpleNamespace(HF_HUB_OFFLINE=False), load_dataset=load_dataset)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(CohortError) as caught:
        load_hub_dataset("openai/gsm8k", "main", "test")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("could not load hub dataset 'openai/gsm8k' (config 'main', split 'test'): the Hugging "
                              f"Face hub cannot be reached ({CLOSED_PORT}:")
    assert message.endswith("not in the datasets cache; pass a local file with data_files")
    assert seen == [("openai/gsm8k", "main", "test", True)]  # one call, in offline mode (the cache only)
    assert fake.config.HF_HUB_OFFLINE is False  # restored


def test_hub_dataset_with_the_real_datasets_package_fails_fast(dead_hub):
    pytest.importorskip("datasets")
    from cohort_grpo.tasks.data import load_hub_dataset

    started = time.monotonic()
    with pytest.raises(CohortError, match="cannot be reached.*data_files"):
        load_hub_dataset("cohort-test/not-a-dataset", None, "train")
    assert time.monotonic() - started < 15  # not five retries with back-off (~25 s)


# ---- where cohort-grpo eval writes --------------------------------------------------------------------

def eval_argv(model, *extra):
    return ["eval", "--model", str(model), "--limit", "3", "--max_completion_length", "4", "--device", "cpu", *extra]


def saved_model(folder: Path, seed: int = 0, marker: str | None = None) -> Path:
    """A tiny model saved in `folder`, with cohort's `marker` file beside it (None: a plain Hugging Face folder)."""
    from cohort_grpo.models.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if marker is not None:
        (folder / marker).write_text("{}\n")
    return folder


def test_two_runs_write_beside_themselves(tmp_path, monkeypatch, capsys):
    """A training run's folder (its metrics.jsonl) and an SFT output (sft_losses.json): each its own eval/."""
    monkeypatch.chdir(tmp_path)
    folders = [saved_model(tmp_path / "run-0", 0, "metrics.jsonl"), saved_model(tmp_path / "sft-1", 1, "sft_losses.json")]
    printed = []
    for folder in folders:
        assert main(eval_argv(folder)) == 0
        printed.append(capsys.readouterr().out)
    for folder, out in zip(folders, printed):
        results = folder / "eval" / "arithmetic_test.jsonl"
        assert len(results.read_text().splitlines()) == 3
        assert json.loads((folder / "eval" / "arithmetic_test.summary.json").read_text())["model"] == str(folder)
        assert f"per-question results: {results}" in out
    assert not (tmp_path / "runs").exists()


def test_a_folder_cohort_did_not_write_is_not_written_into(tmp_path, monkeypatch, capsys):
    """A downloaded model folder: the results go under runs/eval/<its name>, the folder stays as it was."""
    monkeypatch.chdir(tmp_path)
    folder = saved_model(tmp_path / "downloads" / "smol")
    before = sorted(path.name for path in folder.iterdir())
    assert main(eval_argv(folder)) == 0
    expected = Path("runs") / "eval" / "smol" / "arithmetic_test.jsonl"
    assert len((tmp_path / expected).read_text().splitlines()) == 3
    assert f"per-question results: {expected}" in capsys.readouterr().out
    assert sorted(path.name for path in folder.iterdir()) == before


def test_output_dir_and_output(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(eval_argv(tiny_dir, "--output_dir", str(tmp_path / "results"), "--split", "validation")) == 0
    assert (tmp_path / "results" / "arithmetic_validation.jsonl").is_file()
    assert f"per-question results: {tmp_path / 'results' / 'arithmetic_validation.jsonl'}" in capsys.readouterr().out
    assert main(eval_argv(tiny_dir, "--output", str(tmp_path / "one.jsonl"))) == 0
    assert (tmp_path / "one.jsonl").is_file() and (tmp_path / "one.summary.json").is_file()
    assert main(eval_argv(tiny_dir, "--output", "a.jsonl", "--output_dir", "b")) == 2
    assert "pass one of them" in capsys.readouterr().err


def test_the_built_in_model_writes_under_runs_eval(tiny_dir, tmp_path, monkeypatch, capsys):
    import cohort_grpo.sft.builtin

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cohort_grpo.sft.builtin, "tiny_model_dir", lambda log=print, **_: tiny_dir)
    assert main(["eval", "--limit", "2", "--max_completion_length", "4", "--device", "cpu"]) == 0
    expected = Path("runs") / "eval" / "builtin-tiny" / "arithmetic_test.jsonl"
    assert (tmp_path / expected).is_file()
    assert f"per-question results: {expected}" in capsys.readouterr().out


def test_default_places_for_hub_ids_gguf_files_and_unwritable_folders(tmp_path, monkeypatch):
    from cohort_grpo.cli.eval import check_writable, default_output_dir

    monkeypatch.chdir(tmp_path)
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert default_output_dir(hub_id) == Path("runs/eval/HuggingFaceTB--SmolLM2-135M-Instruct")
    assert default_output_dir(None) == Path("runs/eval/builtin-tiny")
    gguf = tmp_path / "models" / "smol.Q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert default_output_dir(str(gguf)) == Path("runs/eval/smol.Q4.gguf")  # a file cohort did not write
    checkpoint = tmp_path / "run" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    assert default_output_dir(str(checkpoint)) == Path("runs/eval/checkpoint-4")  # no complete.json: not cohort's
    (checkpoint / "complete.json").write_text("{}")
    assert default_output_dir(str(checkpoint)) == checkpoint / "eval"
    locked = tmp_path / "locked-model"
    locked.mkdir()
    (locked / "metrics.jsonl").write_text("")
    monkeypatch.setattr("cohort_grpo.cli.eval.os.access", lambda path, mode: Path(path) != locked)
    assert default_output_dir(str(locked)) == Path("runs/eval/locked-model")  # not writable: under runs/eval
    with pytest.raises(CohortError, match=r"cannot write .*locked-model/x.jsonl \(permission denied\)"):
        check_writable(locked / "x.jsonl")
