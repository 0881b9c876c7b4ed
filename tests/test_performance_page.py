"""bench/performance_page.py writes docs/performance.md's tables: a result replaces the row of its
(kind, shape, card, configuration), every other row and the hand-written text stay, and the page
never passes its line limit. bench/grpo_step_report.py turns bench/grpo_step.py's JSON into rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


page_module = load("performance_page")

INTRO = "# Performance\n\nHand-written text that the writer must keep.\n"


def step(shape="Qwen2.5-0.5B shape", card="H100 80GB HBM3", configuration="torch_compile=true", cohort=2.0,
         trl=16.0, date="2026-11-27 01:20", **extra):
    return dict(kind="grpo_step", shape=shape, card=card, configuration=configuration, date=date,
                command=f"python bench/grpo_step.py --cohort-options {configuration}", cohort_seconds=cohort,
                trl_seconds=trl, cohort_peak_gib=11.4, trl_peak_gib=13.2, sampling_seconds=1.1, logprobs_seconds=0.4,
                update_seconds=1.3, mfu=0.31, **extra)


def rows_of(text: str) -> list[list[str]]:
    return [page_module._cells(line) for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| configuration", "| ---"))]


def test_a_result_replaces_the_row_of_its_key_and_keeps_the_others(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text(INTRO)
    write = page_module.write_result
    write(step(configuration="a", cohort=2.0), page)
    write(step(configuration="b", cohort=4.0), page)
    write(step(shape="Qwen2.5-1.5B shape", configuration="a", cohort=8.0), page)
    write(step(card="H200", configuration="a", cohort=5.0), page)
    text = page.read_text()
    assert text.startswith(INTRO)
    assert text.count("### Qwen2.5-0.5B shape on H100 80GB HBM3") == 1
    assert len(rows_of(text)) == 4

    write(step(configuration="a", cohort=1.6, date="2026-12-01 09:00"), page)  # measured again
    text = page.read_text()
    rows = rows_of(text)
    assert len(rows) == 4  # replaced, not added
    by_speed = {(r[0], r[2]) for r in rows}
    assert ("a", "1.60 / 16.00") in by_speed and ("a", "2.00 / 16.00") not in by_speed
    assert ("b", "4.00 / 16.00") in by_speed  # same table, other configuration
    assert ("a", "8.00 / 16.00") in by_speed and ("a", "5.00 / 16.00") in by_speed  # other shape, other card
    assert "| a | 10.00× | 1.60 / 16.00 | 11.4 / 13.2 (0.86×) | 1.10 / 0.40 / 1.30 | 31.0% | 2026-12-01 09:00 |" in text
    assert text.startswith(INTRO)
    # the replaced row stays where it was: first in its table, before "b"
    assert text.index("| a | 10.00×") < text.index("| b |")


def test_new_tables_of_a_kind_follow_that_kind_and_hand_text_stays_put(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text(INTRO)
    write = page_module.write_result
    write(step(), page)
    with page.open("a") as f:
        f.write("\nNotes under the step tables.\n")
    write(dict(kind="capacity", shape="Qwen2.5-7B shape", card="H200", configuration="full parameters",
               date="2026-11-26 23:44", command="python bench/grpo_step.py --max-full-param 7b", peak_gib=104.4,
               card_gib=140.4, seconds=3.25), page)
    write(step(shape="Qwen2.5-1.5B shape"), page)
    text = page.read_text()
    assert text.index("### Qwen2.5-1.5B shape") < text.index("Notes under the step tables.") < text.index(
        "## What fits in memory")
    assert "| full parameters | 104.4 / 140.4 (74%) | 2026-11-26 23:44 |" in text


def test_the_page_stays_within_its_line_limit_dropping_the_oldest_other_rows(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text(INTRO + "\n".join(f"text line {i}" for i in range(200)) + "\n")
    dropped = []
    for i in range(150):  # 30 tables of 5 configurations: far more than fits
        dropped += page_module.write_result(
            step(shape=f"Shape {i // 5}", configuration=f"c{i % 5}", date=f"2026-11-{1 + i // 10:02d} {i % 10:02d}:00"),
            page, max_lines=300)
        assert len(page.read_text().splitlines()) <= 300
    text = page.read_text()
    assert "text line 199" in text  # hand-written text is never dropped
    assert "| c4 |" in text and "### Shape 29 on" in text  # the newest row is kept
    assert dropped and "Shape 0 on H100 80GB HBM3: c0" == dropped[0]  # the oldest went first
    assert "### Shape 0 on" not in text  # an emptied table goes with its heading
    with pytest.raises(ValueError, match="shorten"):  # hand-written text alone over the limit
        page_module.write_result(step(shape="Other"), page, max_lines=150)


def test_bad_results_are_refused(tmp_path):
    page = tmp_path / "performance.md"
    with pytest.raises(ValueError, match="command"):
        page_module.write_result({**step(), "command": ""}, page)
    with pytest.raises(ValueError, match="unknown kind"):
        page_module.write_result({**step(), "kind": "nope"}, page)


def test_the_real_page_parses_and_fits():
    text = (BENCH.parent / "docs" / "performance.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= page_module.MAX_LINES
    found = page_module.tables(lines)
    assert {t.kind for t in found} >= {"grpo_step", "sampling"}
    for table in found:
        assert page_module._cells(lines[table.marker + 1])[:1] == ["configuration"]
        assert all(len(page_module._cells(lines[i])) == len(page_module._cells(lines[table.marker + 1]))
                   for i in table.rows)


def test_grpo_step_report_writes_same_call_comparisons(tmp_path, monkeypatch, capsys):
    report = load("grpo_step_report")
    cohort = dict(status="ok", steady_seconds=2.85, peak_gib=11.4,
                  steady={"time/sampling": 1.12, "time/logprobs": 0.36, "time/update": 1.32, "mfu": 0.313})
    results = dict(
        date="2026-11-27T01:20:05", device="NVIDIA H100 80GB HBM3", smoke=False, notes=[], lora_7b=None,
        argv=["--models", "0.5b,1.5b", "--cohort-options", "torch_compile=true,max_memory_gib=13.2"],
        batch=dict(prompts=32, generations=8, prompt_len=128, completion_len=512, per_device=32, grad_accum=8),
        options=dict(gradient_checkpointing="on", max_tokens_per_micro_batch=None),
        comparisons={
            "qwen2.5-0.5b": dict(trl=dict(status="ok", steady_seconds=16.21, peak_gib=13.2), cohort=cohort,
                                 variants={"cohort-0.5b-v1": {**cohort, "steady_seconds": 3.0,
                                                              "options": {"torch_compile": False}}}),
            "qwen2.5-1.5b": dict(trl=dict(status="skipped"), cohort=cohort),
        },
        max_full_param=dict(batch=dict(prompts=4, generations=8, completion_len=256, per_device=8), largest_fitting="3b",
                            probes={"3b": dict(status="ok", fits=True, steady_seconds=1.83, peak_gib=43.3),
                                    "7b": dict(status="oom", fits=False)}))
    rows, left_out = report.performance_rows(results)
    steps = [r for r in rows if r["kind"] == "grpo_step"]
    assert [(r["shape"], r["card"], r["configuration"]) for r in steps] == [
        ("Qwen2.5-0.5B shape", "H100 80GB HBM3", "torch_compile=true, max_memory_gib=13.2"),
        ("Qwen2.5-0.5B shape", "H100 80GB HBM3", "torch_compile=false")]
    assert steps[0]["date"] == "2026-11-27 01:20" and steps[0]["trl_seconds"] == 16.21
    assert steps[0]["command"].startswith("python bench/grpo_step.py --models 0.5b,1.5b --cohort-options")
    assert len(left_out) == 1 and "qwen2.5-1.5b" in left_out[0]  # no TRL in that call: no row
    (probe,) = [r for r in rows if r["kind"] == "capacity"]
    assert probe["shape"] == "Qwen2.5-3B shape" and probe["card_gib"] == pytest.approx(79.65, abs=0.01)

    json_path, page = tmp_path / "grpo_step.json", tmp_path / "performance.md"
    json_path.write_text(json.dumps(results))
    page.write_text(INTRO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts bench/ on the path
    report.main([str(json_path), "--write-docs", "--page", str(page)])
    text = page.read_text()
    assert "| torch_compile=true, max_memory_gib=13.2 | 5.69× | 2.85 / 16.21 |" in text
    assert "| full parameters, 4 prompts × 8 of 256 tokens; torch_compile=true, max_memory_gib=13.2 |" in text
    assert "GRPO step, cohort vs TRL" in capsys.readouterr().out  # the tables are printed as well
    with pytest.raises(SystemExit):
        json_path.write_text(json.dumps({**results, "smoke": True}))
        report.main([str(json_path), "--write-docs", "--page", str(page)])


def test_an_async_rollouts_report_becomes_its_row():
    report_module = load("async_rollouts_report")

    def summary(tok_per_s, wall, sampling, update):
        return {"tok_per_s": tok_per_s, "wall_s": wall, "time/sampling": sampling, "time/update": update}

    report = {"card": "NVIDIA H200", "date": "2026-11-27T16:11:22", "model": "qwen2.5-0.5b shape (random)",
              "command": "python bench/async_rollouts.py --processes 4 --rollout_gpus 2 --out /root/out",
              "errors": {}, "workload": {"prompts": 32, "G": 8, "max_staleness": 1},
              "lengths": {"median": 1024, "cap": 8192, "mean": 1493.5},
              "modes": {"sync": {"summary": summary(25000.0, 14.0, 7.5, 5.9)},
                        "async": {"summary": summary(37500.0, 10.0, 2.0, 5.5)}}}
    result = report_module.performance_row(report)
    assert (result["card"], result["shape"]) == ("H200 ×4", "Qwen2.5-0.5B shape")
    assert "async 2 sampling + 2 training" in result["configuration"] and "--out" not in result["command"]
    cells = page_module._cells(page_module.row(result))
    assert cells[1:5] == ["1.50×", "10.00 / 14.00", "2.00 / 7.50", "5.50 / 5.90"]
    report["errors"] = {"async": "RuntimeError: hung"}
    with pytest.raises(SystemExit, match="a mode failed"):
        report_module.performance_row(report)
