"""Fixtures shared by several test modules, and the device the suite runs on."""

import os

# The suite asserts CPU behaviour (float32 tolerances, in-process looks at weights a GPU run keeps on
# the host, the default job's learning threshold), as CI runs it. On a machine with a GPU it hides the
# GPU, so `python -m pytest` means the same everywhere; CUDA_VISIBLE_DEVICES is read when CUDA starts,
# which nothing has done yet. COHORT_TEST_GPU=1 keeps the GPU for the GPU tests (README, "Tests").
if os.environ.get("COHORT_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as transformers_logging

from cohort.tiny import build_model, build_tokenizer  # noqa: E402

# transformers binds its log handler to whatever sys.stderr is when its logger is first used. Bind it
# now, to pytest's session-wide capture, not to one test's capsys stream: that stream is closed when
# its test ends, and a later warning would print "--- Logging error ---" and a traceback instead.
transformers_logging.get_logger("transformers")


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
