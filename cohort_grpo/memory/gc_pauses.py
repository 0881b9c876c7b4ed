"""Python's cyclic garbage collector during training: how long it pauses the step, and fewer pauses.

A full (generation-2) collection walks every tracked object. After the first step a training process
holds millions of them that live as long as the run (modules, torch.compile's graphs and guards, the
engine's CUDA graphs), so one full collection can stall the host for a noticeable part of a step at
a moment no one chose, and the GPU idles while the host is stuck. Large training frameworks take the
collector out of the step for this reason (Megatron-LM's manual GC).

`gc.freeze()` after the first step, once that long-lived set exists, moves it to a permanent
generation that collections no longer walk; objects made later are collected as usual. The cost:
cyclic garbage among the frozen objects is never reclaimed, which matters only for objects a run
builds once and later drops (a released engine's graphs), a one-off amount. The trainer thaws them
when `train()` returns or raises.
"""

from __future__ import annotations

import gc
import time

# Seconds collected so far, the running collection's start, and whether this module froze objects
# (gc.freeze is process-wide: thaw only what we froze).
_state = {"seconds": 0.0, "started": None, "frozen": False}


def _on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _state["started"] = time.perf_counter()
    elif _state["started"] is not None:
        _state["seconds"] += time.perf_counter() - _state["started"]
        _state["started"] = None


def collector_seconds() -> float:
    """Seconds the collector has run in this process since the first call."""
    if _on_collection not in gc.callbacks:
        gc.callbacks.append(_on_collection)
    return _state["seconds"]


def freeze_long_lived_objects() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how many."""
    # gc.unfreeze thaws everything: only a freeze that started from nothing frozen can be undone without
    # thawing what another part of the process froze for itself.
    _state["frozen"] = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_frozen_objects() -> None:
    """Undo `freeze_long_lived_objects` at the end of a run, so that a later run in the same process
    (a sweep, a notebook) can reclaim this run's model, engine and graphs once they are dropped."""
    if _state["frozen"]:
        gc.unfreeze()
        _state["frozen"] = False
