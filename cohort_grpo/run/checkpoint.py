"""Never lose a run: atomic checkpoints, exact resume, faults that stay local (docs/reliability.md).

`<output_dir>/checkpoint-<step>/` holds everything the next step depends on — the policy as a Hugging
Face folder, π_ref (β > 0), optimizer + LR-scheduler state, every RNG state, the data position, the
metric history, stateful reward functions — so a run killed at any moment (SIGKILL, OOM, preemption)
and resumed gives the same metrics and weights as one never interrupted. It is written into a hidden
temporary folder beside it, each file fsynced, `complete.json` (sizes and sha256 of every file) last,
then renamed into place (atomic on POSIX): a crash mid-write leaves the previous checkpoint the newest
complete one. A folder without `complete.json`, or differing from it, is skipped on resume.

This file writes and verifies the folders; `checkpoint_load.py` reads them; `lifecycle.py` is the
run around them (resume, periodic saves, signals). A checkpoint is written from `RunParts` (the
run's objects) and `RunState` (its plain values); loading restores the objects in place and returns
the state.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager

import numpy as np
import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.telemetry.metrics import COMPLETIONS_FILE, METRICS_FILE
from cohort_grpo.models.policy import save_policy
from cohort_grpo.parallel.colocation import gathered_state, holds_shards

PREFIX = "checkpoint-"
MARKER = "complete.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
REFERENCE_FILE = "reference.safetensors"
REWARD_DIR = "reward_funcs"
EXTRA_FILE = "trainer_extra.pt"
TEMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-checkpoint-"
FORMAT_VERSION = 1


@dataclass
class RunParts:
    """The objects of a run that a checkpoint saves, and restores in place."""

    args: Any  # GRPOConfig
    model: Any  # the policy π_θ (the full copy under FSDP; the FSDP2 module itself when colocated)
    tokenizer: Any
    train_model: Any  # what the update calls: the model, or its DDP / FSDP wrapper
    optimizer: Any
    scheduler: Any
    ref_model: Any | None  # π_ref, when it is a separate copy
    reference_pass: Callable[..., ContextManager]  # π_ref's weights on the device inside (MemoryManager)
    reward_funcs: list
    parallel: Any  # cohort_grpo.parallel.distributed.Parallel
    extra_state: Callable[[], dict | None] | None = None  # a trainer subclass's own state (PPO's critic)
    load_extra_state: Callable[[dict], None] | None = None
    engine_copy: Any | None = None  # FSDP2: the engine's copy of the weights (EngineCopy), refreshed once they load


@dataclass
class RunState:
    """The plain values of a run at the end of a step."""

    step: int
    prompts: dict  # PromptStream.state_dict(): the data order and its random generator
    history: list[dict]  # the per-step records; `history_length` of them where the list is the running run's
    accuracy_before: float | None = None
    skipped_steps: int = 0
    nonfinite_in_a_row: int = 0
    seconds: float = 0.0  # time spent training so far, over every attempt of the run
    # Noted at the step's end for a checkpoint written later (a failure in the next step, cohort_grpo/run/failure.py):
    # this process's RNG states then (`random_state()`) and the logs' sizes then (`log_sizes`); None: as they are now.
    random: dict | None = None
    file_sizes: dict | None = None
    # A state noted at every step's end shares the run's history, which grows on, rather than copying it (a copy a
    # step is work that grows with the steps): its records are the list's first `history_length`. None: all of them.
    history_length: int | None = None

    def records(self) -> list[dict]:
        """The per-step records as of this state."""
        return self.history if self.history_length is None else self.history[:self.history_length]


FULL_BELOW = 1 << 20  # bytes free under which a failed write is taken for a full disk


# ---- writing -----------------------------------------------------------------------------------

def save_checkpoint(parts: RunParts, state: RunState) -> Path:
    """Write checkpoint-<step> atomically, then keep the newest save_total_limit checkpoints.

    Several ranks: every rank hands over its part (its RNG states; under FSDP2 the gathered optimizer
    state and fp32 weights), rank 0 alone writes, and a failure there is raised on every rank."""
    out, step = Path(parts.args.output_dir), state.step
    final = out / f"{PREFIX}{step}"
    parallel = parts.parallel
    shared = {"optimizer": parallel.optimizer_state(parts.train_model, parts.optimizer) if parallel.fsdp else None,
              "rank_random": parallel.gather_objects(state.random or random_state()) if parallel.world_size > 1 else None,
              # an FSDP2-sharded π_ref (the colocated placement): gathered whole on rank 0
              "reference": gathered_state(parts.ref_model) if sharded(parts.ref_model) else None}
    failure = None
    if parallel.is_main:
        try:
            _write_checkpoint(parts, state, out, final, shared)
        except BaseException as error:  # noqa: BLE001 - told to the other ranks, then raised here
            failure = error
    message = parallel.broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise CohortError(f"rank 0 failed to save {final.name} ({message}); see its error above")
    return final


def _write_checkpoint(parts: RunParts, state: RunState, out: Path, final: Path, shared: dict) -> None:
    step = state.step
    remove_leftovers(out)
    temp = out / f"{TEMP_PREFIX}{step}-{os.getpid()}"
    try:
        temp.mkdir()
        _write_contents(parts, state, temp, shared)
        _write_manifest(temp, step)
        _replace_folder(temp, final)
    except Exception as error:
        disk_full = _is_disk_full(error, out)  # asked while the half-written folder still fills the disk
        shutil.rmtree(temp, ignore_errors=True)
        previous = [c.name for c in list_checkpoints(out) if c != final]
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        if disk_full:
            raise CohortError(f"disk full while saving {final.name} in {out}: free space there (or lower "
                              f"--save_total_limit), then continue with --resume; {kept}") from error
        if isinstance(error, OSError):
            raise CohortError(f"cannot save {final.name} in {out} ({error.strerror or error}); make the folder "
                              f"writable, then continue with --resume; {kept}") from error
        raise
    prune_checkpoints(out, parts.args.save_total_limit)


def _write_contents(parts: RunParts, run: RunState, folder: Path, shared: dict | None = None) -> None:
    from cohort_grpo.models.files import save_safetensors
    from cohort_grpo.models.lora import base_state_dict, has_lora

    policy = None
    if sharded(parts.model):  # no whole copy to save: the gathered fp32 weights, in the run's dtype
        policy = {name: tensor.to(getattr(torch, parts.args.dtype))
                  for name, tensor in shared["optimizer"]["fsdp_weights"].items()}
    save_policy(parts.model, parts.tokenizer, folder, state=policy)
    if shared and shared.get("reference") is not None:
        save_safetensors(_untied(shared["reference"]), folder / REFERENCE_FILE, metadata=None)
    elif parts.ref_model is not None:
        with parts.reference_pass():
            state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in parts.ref_model.state_dict().items()}
        save_safetensors(_untied(state), folder / REFERENCE_FILE, metadata=None)
    elif has_lora(parts.model) and parts.args.ref_reset_steps:  # resets fold adapters into the base
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in base_state_dict(parts.model).items()}
        save_safetensors(_untied(state), folder / REFERENCE_FILE, metadata=None)
    if shared and shared["optimizer"] is not None:  # FSDP2: gathered from every rank's shard
        _save_optimizer(parts, folder / OPTIMIZER_FILE, shared["optimizer"])
    else:
        _save_optimizer(parts, folder / OPTIMIZER_FILE)
    extra = parts.extra_state() if parts.extra_state is not None else None
    if extra is not None:  # a trainer subclass's own state (PPO's critic)
        torch.save(extra, folder / EXTRA_FILE)
    for index, func in enumerate(parts.reward_funcs):
        if callable(getattr(func, "state_dict", None)) and callable(getattr(func, "load_state_dict", None)):
            (folder / REWARD_DIR / str(index)).mkdir(parents=True)
            torch.save(func.state_dict(), folder / REWARD_DIR / str(index) / "state.pt")
    out = Path(parts.args.output_dir)
    state = {
        "format": FORMAT_VERSION,
        "step": run.step,
        "model_shapes": {k: list(v.shape) for k, v in parts.model.state_dict().items()},
        "data_order": list(run.prompts["data_order"]),
        "data_rng": python_state(run.prompts["data_rng"]),
        "data_rows": run.prompts.get("rows"),  # how many rows data_order indexes (a resume may be given others)
        **(run.random or random_state()),  # rank 0's, and with several ranks each rank's in rank_random
        "world_size": parts.parallel.world_size,
        "rank_random": shared["rank_random"] if shared else None,
        "history": run.records(),
        "accuracy_before": run.accuracy_before,
        "skipped_steps": run.skipped_steps,
        "nonfinite_in_a_row": run.nonfinite_in_a_row,
        "seconds": run.seconds,
        "file_sizes": run.file_sizes if run.file_sizes is not None else log_sizes(out),
        "config": parts.args.to_dict(),
    }
    (folder / TRAINER_STATE).write_text(json.dumps(state, default=_plain) + "\n")


def log_sizes(out: Path) -> dict:
    """metrics.jsonl / completions.jsonl are flushed per line: their sizes at a step's end mark that step's end."""
    return {name: (out / name).stat().st_size if (out / name).exists() else 0 for name in (METRICS_FILE, COMPLETIONS_FILE)}


def sharded(module) -> bool:
    """Whether `module` is an FSDP2-sharded model (the policy and π_ref of the colocated placement)."""
    return module is not None and holds_shards(module)


def _save_optimizer(parts: RunParts, path: Path, gathered: dict | None = None) -> None:
    optimizer = gathered if gathered is not None else parts.optimizer.state_dict()
    torch.save({"optimizer": optimizer, "scheduler": parts.scheduler.state_dict()}, path)


def random_state() -> dict:
    """This process's RNG states (Python, numpy, torch, CUDA) as JSON."""
    return {"python_random": python_state(random.getstate()), "numpy_random": _numpy_state(),
            "torch_random": torch.get_rng_state().tolist(),
            "cuda_random": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_initialized() else None}


def restore_random(state: dict) -> None:
    random.setstate(python_state(state["python_random"], restore=True))
    np.random.set_state(_numpy_state(state["numpy_random"]))
    torch.set_rng_state(torch.tensor(state["torch_random"], dtype=torch.uint8))
    if state.get("cuda_random") and torch.cuda.is_available() and len(state["cuda_random"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda_random"]])


def _write_manifest(folder: Path, step: int) -> None:
    """Fsync every file and record its size and sha256; complete.json itself is written last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        files[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path, fsync=True)}
    marker = folder / MARKER
    with open(marker, "w") as handle:
        json.dump({"format": FORMAT_VERSION, "step": step, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    for directory in sorted({p.parent for p in folder.rglob("*")} | {folder}):
        _fsync_dir(directory)


def _replace_folder(temp: Path, final: Path) -> None:
    """rename(temp → final); an existing final (an old fork of this step) is moved aside first."""
    trash = None
    if final.exists():
        trash = final.parent / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
        os.rename(final, trash)
    os.rename(temp, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def prune_checkpoints(out: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (0 keeps all); older broken ones go too."""
    if keep <= 0:
        return
    folders = list_checkpoints(out)
    complete = [f for f in folders if check_checkpoint(f, hashes=False) is None]
    if len(complete) <= keep:
        return
    oldest_kept = step_of(complete[-keep])
    for folder in folders:
        if step_of(folder) < oldest_kept:
            shutil.rmtree(folder, ignore_errors=True)


def remove_leftovers(out: Path) -> None:
    """Temporary folders of writes that were killed midway (nothing refers to them)."""
    for path in out.glob(".*-checkpoint-*"):
        if path.is_dir() and path.name.startswith((TEMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)


# ---- finding and checking ----------------------------------------------------------------------

def list_checkpoints(out: Path) -> list[Path]:
    """checkpoint-<step> folders in `out`, oldest first (complete or not)."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=step_of)


def check_checkpoint(folder: Path, hashes: bool = True) -> str | None:
    """None when `folder` is a complete, intact checkpoint, else why not ("incomplete (…)", "corrupt (…)")."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder" if folder.exists() else "missing"
    marker = folder / MARKER
    if not marker.is_file():
        return f"incomplete (no {MARKER}: its write was interrupted)"
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"corrupt ({MARKER} is not a valid manifest)"
    if TRAINER_STATE not in files:
        return f"corrupt ({MARKER} lists no {TRAINER_STATE})"
    for name, expected in files.items():
        path = folder / name
        try:  # a checkpoint a live run rotates away (save_total_limit) may lose its files while it is read
            size = path.stat().st_size if path.is_file() else None
            if size is None:
                return f"corrupt ({name} is missing)"
            if size != expected["bytes"]:
                return f"corrupt ({name} has {size} bytes, its manifest says {expected['bytes']})"
            if hashes and _sha256(path) != expected["sha256"]:
                return f"corrupt ({name} differs from its manifest's sha256)"
        except FileNotFoundError:
            return f"corrupt ({name} is missing)"
    return None


def newest_complete(out: Path, log=print) -> Path | None:
    """The newest checkpoint that passes `check_checkpoint`; each newer broken one is reported in one line."""
    for folder in reversed(list_checkpoints(out)):
        reason = check_checkpoint(folder)
        if reason is None:
            return folder
        log(f"skipping {folder.name}: {reason}")
    return None


# ---- loading: cohort_grpo/run/checkpoint_load.py ----------------------------------------------------------

def truncate_logs(out: Path, sizes: dict, log) -> None:
    """Cut metrics.jsonl / completions.jsonl back to their size at the checkpoint: the lines the killed
    attempt wrote after it are written again, identically, by the resumed run."""
    for name, size in sizes.items():
        path = out / name
        if path.exists() and path.stat().st_size >= size:
            os.truncate(path, size)  # the logger's append-mode handle keeps writing at the new end
        elif path.exists():
            log(f"{name} is shorter than when the checkpoint was saved; appending to it as it is")


# ---- small helpers -----------------------------------------------------------------------------

def _plain(value):
    """JSON for a metric someone logged as a tensor / numpy scalar."""
    return value.item() if hasattr(value, "item") else str(value)


def step_of(folder: Path) -> int:
    return int(Path(folder).name[len(PREFIX):])


def _untied(state: dict) -> dict:
    """safetensors refuses two names for one storage: keep the first name of each."""
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def python_state(state, restore: bool = False):
    """random.Random state ↔ JSON: (version, tuple of 625 ints, gauss_next)."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss) if restore else [version, list(internal), gauss]


def _numpy_state(saved=None):
    """numpy's legacy global state ↔ JSON: (name, 624 uint32 keys, pos, has_gauss, cached_gaussian)."""
    if saved is None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return saved[0], np.array(saved[1], dtype=np.uint32), *saved[2:]


def _sha256(path: Path, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_disk_full(error: BaseException, out: Path) -> bool:
    """ENOSPC / EDQUOT, also when a library wrapped it (torch.save: "file write failed", or its zip writer's
    "unexpected pos" after a short write; safetensors: "No space left on device"), or any failure of a write
    that left less than `FULL_BELOW` bytes free in `out`."""
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    text = str(error)
    if any(words in text for words in ("No space left", "os error 28", "file write failed", "unexpected pos")):
        return True
    try:
        return shutil.disk_usage(out).free < FULL_BELOW
    except OSError:
        return False
