"""bench/soak.py, the long-run drift bench, on fake steps: the recorder's work between two steps does not grow with
the steps (a JSON of every record rewritten after each step did, a growing pause between a long run's steps), a run
cut short is summarized from its records file, and the summary traces a slower step to where its time went."""

from __future__ import annotations

import importlib.util
import json
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def soak():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_step(step: int, seconds: float = 0.1) -> SimpleNamespace:
    """What the trainer hands its callbacks at a step's end: the step, and the log with its step record."""
    record = {"step": step, "step_time": seconds - 0.01, "time/sampling": seconds / 2, "time/update": seconds / 4,
              "time/gc": 0.0}
    return SimpleNamespace(global_step=step, log_history=[record])


META = dict(device="cpu", device_name="cpu", warmup=5)


def test_the_work_between_two_steps_does_not_grow_with_the_steps(soak, tmp_path):
    out = tmp_path / "soak.json"
    records: list = []
    recorder = soak.step_recorder({}, records, out, started=0.0, budget_s=1e12, meta=META)
    control = SimpleNamespace(should_training_stop=False)
    lines = soak.records_path(out)

    def one_step(step: int) -> tuple[int, int]:
        """(bytes the step added to the records file beyond its own record's line, the most memory the recorder
        took meanwhile)."""
        size = lines.stat().st_size
        tracemalloc.start()
        try:
            recorder.on_step_end(None, fake_step(step), control)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return lines.stat().st_size - size - len(json.dumps(records[-1]) + "\n"), peak

    measured = {}
    for step in range(1, 2002):
        if step in (11, 2001):  # not a 50th step, which counts the collector's objects too
            measured[step] = one_step(step)
        else:
            recorder.on_step_end(None, fake_step(step), control)
    (written_early, peak_early), (written_late, peak_late) = measured[11], measured[2001]
    assert written_early == written_late == 0, measured  # each step writes its own record's line, no more
    assert peak_late < peak_early + 16 * 1024, measured  # a JSON of 2,000 records alone is about 700 KB
    assert not out.exists()  # the whole JSON is the end's
    recorder.on_train_end(None, None, control)
    meta, kept = soak.read_records(lines)
    assert meta == META and kept == records and [r["step"] for r in kept] == list(range(1, 2002))


def test_a_run_cut_short_is_summarized_from_its_records(soak, tmp_path, capsys):
    records = synthetic_records(30)
    lines = tmp_path / "soak.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in [META, *records])
                     + '{"step": 31, "seconds"')  # the run was killed while writing this line
    out = tmp_path / "soak.json"
    assert soak.main(["--summarize", str(lines), "--out", str(out)]) == 1  # a slowdown of 20%: FAIL
    written = json.loads(out.read_text())
    assert [r["step"] for r in written["records"]] == list(range(1, 31))
    assert written["summary"] == soak.summarize(records, 5, "cpu")
    assert "step seconds (mean)" in capsys.readouterr().out


def synthetic_records(steps: int) -> list[dict]:
    """Steps that slow by 20 ms after step 25, outside the trainer's phases and its own step clock, with a full
    collection each."""
    return [dict(step=step, seconds=0.1 + (0.02 if step > 25 else 0.0), trainer_step_s=0.09, rss_mib=500.0,
                 allocated_mib=None, reserved_mib=None, compiled_graphs=0, graph_captures=None,
                 phases={"sampling": 0.05, "update": 0.03, "gc": 0.001},
                 gc_collections=[step * 10, step, max(0, step - 25)])
            for step in range(1, steps + 1)]


def test_the_summary_says_where_a_slower_step_s_time_went(soak):
    """The causes show where the 20 ms went: outside the phases and the trainer's step, with full collections."""
    records = synthetic_records(30)
    causes = soak.summarize(records, 5, "cpu")["causes"]
    assert causes["time/sampling"]["change"] == 0.0
    assert causes["outside phases"]["early"] == pytest.approx(0.02)  # 0.1 − (0.05 + 0.03): gc is inside them
    assert causes["outside phases"]["late"] == pytest.approx(0.04)
    assert causes["outside trainer step"]["late"] == pytest.approx(0.03)
    assert causes["gc gen2 per step"]["early"] == 0 and causes["gc gen2 per step"]["late"] == 1
