"""The built-in tiny models (`cohort:tiny-arithmetic`, the default, and `cohort:tiny-tools`): built from
`cohort_grpo.models.tiny`'s specs, warm-started by a short supervised pass on first use, and cached (under
`~/.cache/cohort`, or $COHORT_CACHE) so later runs load a folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from cohort_grpo.errors import CohortError
from cohort_grpo.models.tiny import (TINY_SPEC, TINY_TOOLS_MODEL, TINY_TOOLS_SPEC, build_model, build_tokenizer,
                                build_tools_tokenizer, cache_root)
from cohort_grpo.sft.sft_tools import tools_warm_start
from cohort_grpo.sft.sft_trainer import tiny_warm_start


def tiny_model_dir(log=print, spec: dict = TINY_SPEC) -> Path:
    """Path of the warm-started tiny model, building and caching it on first use."""

    def build():
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=spec["sft_seed"], spec=spec)
        tiny_warm_start(model, tokenizer, spec, log=log)
        return model, tokenizer

    return cached_model("tiny-arithmetic", spec, build, log, "the built-in tiny model")


def tiny_tools_model_dir(log=print, spec: dict = TINY_TOOLS_SPEC) -> Path:
    """Path of the warm-started tiny tools model, building and caching it on first use."""

    def build():
        tokenizer = build_tools_tokenizer(spec)
        model = build_model(tokenizer, seed=spec["sft_seed"], spec=spec)
        tools_warm_start(model, tokenizer, spec, log=log)
        return model, tokenizer

    return cached_model("tiny-tools", spec, build, log, "the built-in tiny tools model")


BUILDERS = {"cohort:tiny-arithmetic": tiny_model_dir, TINY_TOOLS_MODEL: tiny_tools_model_dir}


def builtin_model_dir(name: str, log=print) -> Path:
    """The folder of the built-in model `name` (one of `cohort_grpo.models.tiny.BUILTIN_MODELS`), built on first use."""
    if name not in BUILDERS:
        raise CohortError(f"unknown built-in model {name!r}; choose one of {sorted(BUILDERS)}")
    return BUILDERS[name](log=log)


def cached_model(prefix: str, spec: dict, build, log, what: str) -> Path:
    """`cache_root()/<prefix>-<hash of spec>`, made by `build() -> (model, tokenizer)` when missing."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root() / f"{prefix}-{key}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    log(f"Building {what} (one-time SFT warm start, cached in {target}) ...")
    model, tokenizer = build()
    # Write to a temporary folder and rename: a killed build never leaves a half-written cache.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race; keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target
