"""Fixtures shared by several test modules."""

import pytest
import torch
from transformers.utils import logging as transformers_logging

from cohort.tiny import build_model, build_tokenizer

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
