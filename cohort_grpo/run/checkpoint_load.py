"""Loading the checkpoints that cohort_grpo/run/checkpoint.py writes and verifies.

`load_checkpoint` restores everything `checkpoint.save_checkpoint` saved into a run's objects, in
place: weights (or LoRA adapters), π_ref, optimizer and scheduler (fp32 masters included), a
trainer subclass's and the reward functions' state, the RNG states and the logs; it returns the
plain values (`RunState`) for the trainer to take. Every file is read with
`torch.load(weights_only=True)` or safetensors: no pickled code runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cohort_grpo.errors import CohortError
from cohort_grpo.run.checkpoint import (EXTRA_FILE, OPTIMIZER_FILE, REFERENCE_FILE, REWARD_DIR, TRAINER_STATE, RunParts, RunState,
                         check_checkpoint, python_state, restore_random, sharded, truncate_logs)
from cohort_grpo.parallel.colocation import load_gathered_state


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint was saved after (a curriculum enters that step's stage before loading)."""
    return int(json.loads((Path(folder) / TRAINER_STATE).read_text())["step"])


def ends_its_run(folder: Path) -> bool:
    """Whether `folder` is a complete checkpoint of its run's last step: a run that finished, which a new run in
    the same output_dir may replace (an unfinished one is what --resume continues)."""
    if check_checkpoint(folder, hashes=False) is not None:
        return False
    try:
        state = json.loads((Path(folder) / TRAINER_STATE).read_text())
        return int(state["step"]) >= int(state["config"]["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def load_checkpoint(parts: RunParts, folder: Path, log=print) -> RunState:
    """Restore everything `save_checkpoint` saved into `parts`; the run's plain values are returned."""
    from cohort_grpo.models.lora import ADAPTER_WEIGHTS, has_lora, load_adapter_state_dict, load_base_state_dict
    from cohort_grpo.models.loading import read_safetensors, safetensors_files

    folder = Path(folder)
    state = json.loads((folder / TRAINER_STATE).read_text())
    parallel = parts.parallel
    if state.get("world_size", 1) != parallel.world_size:
        raise CohortError(f"{folder} was written by {state.get('world_size', 1)} process(es), this run has "
                          f"{parallel.world_size}; resume with --nproc_per_node {state.get('world_size', 1)}")
    _check_same_model(parts.model, state.get("model_shapes", {}), folder)
    if has_lora(parts.model):  # the adapters, and the base when π_ref resets have folded adapters into it
        if (folder / REFERENCE_FILE).is_file():
            load_base_state_dict(parts.model, read_safetensors([folder / REFERENCE_FILE]))
        load_adapter_state_dict(parts.model, read_safetensors([folder / ADAPTER_WEIGHTS]), folder)
    elif not sharded(parts.model):  # an FSDP2-sharded policy takes its fp32 weights with the optimizer's below
        _load_weights(parts.model, read_safetensors(safetensors_files(folder)), folder)  # sharded files or not
    # mapped, not read whole: an 8B model's masters and moments are tens of GiB, which the optimizer copies tensor by
    # tensor into its own (on the GPU, or its host buffers) — read whole, they would double the host's peak
    saved = _torch_load(folder / OPTIMIZER_FILE, mmap=True)
    if parallel.fsdp:  # the full state and fp32 weights into this rank's shards, then into the engine's copy
        parallel.load_optimizer_state(parts.train_model, parts.optimizer, saved["optimizer"])
        if parts.engine_copy is not None:
            parts.engine_copy.refresh()
    else:
        parts.optimizer.load_state_dict(saved["optimizer"])
    parts.scheduler.load_state_dict(saved["scheduler"])
    if parts.ref_model is not None:
        with parts.reference_pass(modified=True):
            if (folder / REFERENCE_FILE).is_file():
                reference = read_safetensors([folder / REFERENCE_FILE])
                if sharded(parts.ref_model):  # every rank keeps its shard of the whole tensors
                    load_gathered_state(parts.ref_model, reference)
                else:
                    _load_weights(parts.ref_model, reference, folder)
            else:  # the checkpoint was written with β = 0: start a fresh outer iteration from the policy
                parts.ref_model.load_state_dict(parts.model.state_dict())
    if (folder / EXTRA_FILE).is_file() and parts.load_extra_state is not None:
        parts.load_extra_state(_torch_load(folder / EXTRA_FILE))
    for index, func in enumerate(parts.reward_funcs):
        path = folder / REWARD_DIR / str(index) / "state.pt"
        if path.is_file() and callable(getattr(func, "load_state_dict", None)):
            func.load_state_dict(_torch_load(path))
    restore_random(state["rank_random"][parallel.rank] if state.get("rank_random") else state)
    _report_changed_options(state.get("config", {}), parts.args.to_dict(), log)
    if folder.parent.resolve() == Path(parts.args.output_dir).resolve() and parallel.is_main:
        truncate_logs(Path(parts.args.output_dir), state.get("file_sizes", {}), log)
    return RunState(step=int(state["step"]),
                    prompts={"data_order": [int(i) for i in state["data_order"]],
                             "data_rng": python_state(state["data_rng"], restore=True), "rows": state.get("data_rows")},
                    history=state["history"], accuracy_before=state.get("accuracy_before"),
                    skipped_steps=int(state.get("skipped_steps", 0)),
                    nonfinite_in_a_row=int(state.get("nonfinite_in_a_row", 0)),
                    seconds=float(state.get("seconds", 0.0)))


def data_position(saved: dict, step: int, rows: int, log) -> dict:
    """The checkpoint's place in its epoch (`saved`, of checkpoint-`step`), for a run over `rows` training rows: as it
    is, or, when the rows changed in number since (a bad row deleted from the data file), a fresh epoch with the data
    generator kept, said in one line: the saved order indexes rows that may not exist."""
    then = saved.get("rows")
    if (then is None or then == rows) and all(index < rows for index in saved["data_order"]):
        return saved
    counts = f"{then} rows then, {rows} now" if then is not None else f"{rows} rows now, fewer than its order needs"
    log(f"the training rows changed since checkpoint-{step} ({counts}): its place in the epoch cannot be continued, so "
        f"a fresh epoch over the {rows} rows starts at step {step + 1}, and the run differs from an uninterrupted one "
        "from there")
    return {**saved, "data_order": []}


def _report_changed_options(saved: dict, current: dict, log) -> None:
    """One line naming the options that differ from the checkpoint's run (the resumed run then differs too)."""
    ignored = {"resume", "resume_from_checkpoint", "overwrite_output_dir", "output_dir", "quiet", "report_to"}
    changed = [f"{k}: {saved[k]!r} → {current[k]!r}" for k in sorted(saved.keys() & current.keys())
               if k not in ignored and saved[k] != current[k]]
    if changed:
        log(f"resuming with changed options ({'; '.join(changed)})")


def _check_same_model(model, saved_shapes: dict, folder: Path) -> None:
    current = {k: list(v.shape) for k, v in model.state_dict().items()}
    adapters = adapter_difference(saved_shapes, current)
    if adapters is not None:
        raise CohortError(f"{folder} {adapters}")
    for name in sorted(set(current) | set(saved_shapes)):
        if current.get(name) != saved_shapes.get(name):
            raise CohortError(f"{folder} was saved from another model ({name}: shape {saved_shapes.get(name)} there, "
                              f"{current.get(name)} here); resume with the --model it was trained from, or use "
                              "another --output_dir")


def adapter_difference(saved_shapes: dict, current: dict) -> str | None:
    """How the LoRA adapters of a checkpoint (its tensors' shapes by name) differ from the model's, as the rest
    of a one-line refusal naming the option; None where they agree (the same model with other adapters is
    not another model)."""
    def ranks(shapes: dict) -> dict:  # each adapted module's rank, from its lora_A matrix [r, in]
        return {name.split(".lora_A.")[0]: shape[0] for name, shape in shapes.items() if ".lora_A." in name}

    saved, now = ranks(saved_shapes), ranks(current)
    if saved and not now:
        return "was saved by a run with LoRA adapters: resume with --use_peft true and the lora options it used"
    if now and not saved:
        return "was saved by a run without LoRA adapters: resume without --use_peft"
    if saved.keys() != now.keys():
        return ("holds LoRA adapters on other modules than this run's: resume with the lora_target_modules it "
                "was trained with")
    if saved != now:
        rank = next(iter(saved.values()))
        return f"holds LoRA adapters of rank {rank}, not {next(iter(now.values()))}: resume with --lora_r {rank}"
    return None


def _load_weights(model, state: dict, folder: Path) -> None:
    from cohort_grpo.models.moe import fuse_expert_weights

    state = fuse_expert_weights(state)  # a MoE model's folder holds a matrix per expert; the model stacks them
    names = model.saved_names() if hasattr(model, "saved_names") else {}
    if any(key != written and written in state and key not in state for key, written in names.items()):
        # transformers wrote the folder in the family's original names: each tensor back under the model's own
        renamed = {written: key for key, written in names.items() if written in state}
        state = {renamed.get(name, name): tensor for name, tensor in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head is stored once (as the embedding it shares storage with); loading that fills it.
    current = model.state_dict()
    loaded_storage = {current[k].data_ptr() for k in state if k in current}
    untied_missing = [k for k in missing if current[k].data_ptr() not in loaded_storage]
    if untied_missing or unexpected:
        raise CohortError(f"{folder} does not match this model (missing {sorted(untied_missing)[:3]}, "
                          f"unexpected {sorted(unexpected)[:3]}); resume with the --model it was trained from")


def _torch_load(path: Path, mmap: bool = False):
    """Tensors and plain containers only: weights_only=True refuses pickled code. `mmap`: the tensors are pages of the
    file, read as they are used."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # UnpicklingError for anything but tensors / plain data
        raise CohortError(f"cannot load {path} with torch.load(weights_only=True): {type(error).__name__}; "
                          "it is damaged or holds more than tensors and plain data") from None
