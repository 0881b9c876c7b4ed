"""Fixtures shared by several test modules, and the device the suite runs on."""

import os
import subprocess
from pathlib import Path

# CI has no GPU. On a machine with one, `python -m pytest` hides it, so the command means the same
# everywhere; CUDA_VISIBLE_DEVICES is read when CUDA starts, which nothing has done yet.
# COHORT_TEST_GPU=1 keeps the GPU: every test then runs where the code puts it (the GPU when there is
# one), except those marked `cpu` — tests whose numbers are CPU numbers (float32 tolerances, bitwise
# equal runs, the CPU's own paths); the `cpu_pinned` fixture below runs those on the CPU.
if os.environ.get("COHORT_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as transformers_logging

from cohort_grpo.models.tiny import build_model, build_tokenizer# noqa: E402

# transformers binds its log handler to whatever sys.stderr is when its logger is first used. Bind it
# now, to pytest's session-wide capture, not to one test's capsys stream: that stream is closed when
# its test ends, and a later warning would print "--- Logging error ---" and a traceback instead.
transformers_logging.get_logger("transformers")


def pytest_collection_modifyitems(config, items):
    """With -n (pytest-xdist), tests marked slow first (a stable sort: the rest keep their order): a worker
    that draws a minutes-long test late keeps the whole run waiting after the others have finished. A serial
    run keeps each module together, so its module-scoped fixtures are built once."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def cpu_pinned(request, monkeypatch):
    """A test marked `@pytest.mark.cpu("why")` runs on the CPU with the GPU visible (COHORT_TEST_GPU=1):
    `auto` devices resolve to the CPU in this process, and child processes (torchrun, the CLI) see no GPU."""
    marker = request.node.get_closest_marker("cpu")
    if marker is None:
        return
    if not (marker.args or marker.kwargs.get("reason")):
        pytest.fail("@pytest.mark.cpu needs its reason: why the test's numbers are CPU numbers")
    if os.environ.get("COHORT_TEST_GPU") == "1":
        if torch.cuda.is_available():
            # CUDA reads CUDA_VISIBLE_DEVICES once, when it starts: started under the empty value below (by
            # anything this test calls), it would see no GPU for the rest of this worker's tests
            torch.cuda.init()
        # torch caches the device count it computes once CUDA has started, from CUDA_VISIBLE_DEVICES as it is
        # then: a count taken while the GPU is hidden would stay 0 for this worker's later GPU tests
        monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A freshly initialised built-in tiny model (character tokenizer, seed 0) saved as an HF folder;
    one per test module, so no module sees another's changes."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# SmolLM2-135M-Instruct (Q4_1 GGUF): ../shared holds the script that fetches it, not the file itself.
SMOLLM2_GET_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "models" / "smollm2-135m-instruct" / "get.sh"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """Where the tests keep SmolLM2: <COHORT_CACHE or ~/.cache/cohort>/smollm2-135m-instruct."""
    return Path(os.environ.get("COHORT_CACHE") or Path.home() / ".cache" / "cohort") / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file, fetched on first use by get.sh into
    `smollm2_folder()` (which verifies its sha256, and only checks it when already there). Skips,
    naming the folder it looked in and why, when the file is neither there nor fetchable."""
    folder = smollm2_folder()
    if not SMOLLM2_GET_SCRIPT.is_file():
        if (folder / SMOLLM2_FILE).is_file():
            return str(folder / SMOLLM2_FILE)
        pytest.skip(f"SmolLM2-135M-Instruct is not in {folder}, and the script that fetches it "
                    f"({SMOLLM2_GET_SCRIPT}) is not present")
    try:
        done = subprocess.run(["bash", str(SMOLLM2_GET_SCRIPT), str(folder)], capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"SmolLM2-135M-Instruct is not in {folder}, and {SMOLLM2_GET_SCRIPT} did not fetch it in 600 s")
    if done.returncode != 0:
        pytest.skip(f"SmolLM2-135M-Instruct is not in {folder}, and {SMOLLM2_GET_SCRIPT} could not fetch it: "
                    f"{done.stderr.strip()[-300:]}")
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.suffix == ".gguf" and path.is_file(), f"{SMOLLM2_GET_SCRIPT} reported {path}, which is no GGUF file"
    return str(path)
