"""``bench/side_by_side.py``: its ``--cpu`` dry run to the end, and the pieces that decide its figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import ROOT, child_env

SCRIPT = ROOT / "bench" / "side_by_side.py"
_spec = importlib.util.spec_from_file_location("side_by_side", SCRIPT)
assert _spec is not None and _spec.loader is not None
side_by_side = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = side_by_side  # its dataclasses look their module up
_spec.loader.exec_module(side_by_side)


@pytest.mark.slow
def test_the_cpu_dry_run_measures_every_engine_and_resident_row(tmp_path: Path) -> None:
    out = tmp_path / "sbs.json"
    systems = ["engine-sync", "engine-async-24gb", "roundpipe-async", "resident"]
    command = [sys.executable, str(SCRIPT), "--cpu", "--steps", "3", "--out", str(out), "--systems", *systems]
    done = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["systems"]) == systems
    w = side_by_side.CPU_WORKLOAD
    assert report["workload"]["microbatches"] == w.microbatches
    assert report["machine"]["torch"] and report["ceilings"]["cpu_fused_adamw_s_per_1e9"] > 0
    assert report["ceilings"]["gpu"].startswith("skipped")
    for name in ("engine-sync", "engine-async-24gb", "resident"):
        row = report["systems"][name]
        assert "failed" not in row, (name, row.get("stderr_tail"))
        assert row["timed_steps"] == 3 and len(row["step_s"]) == 3 and not row["cut_short_by_budget"]
        assert row["steady_step_s"] == pytest.approx(sorted(row["step_s"])[1])
        assert row["tokens_per_s_steady"] == pytest.approx(w.tokens / row["steady_step_s"])
        overall = 3 * w.tokens / (sum(row["step_s"]) + row["drain_s"])
        assert row["tokens_per_s_overall"] == pytest.approx(overall)
        assert 0.05 < row["rss_max_gib"] < 8 and row["rss_median_gib"] <= row["rss_max_gib"]
    for name in ("engine-sync", "engine-async-24gb"):
        row = report["systems"][name]
        assert row["warmup_steps"] >= 4  # the calibration steps + 2
        assert row["plan"] and row["engine_metrics"]["loss/train"] > 0
    assert report["systems"]["engine-async-24gb"]["memory_budget_gib"] == pytest.approx(10.8)
    assert report["systems"]["engine-sync"]["memory_budget_gib"] is None
    assert "CUDA" in report["systems"]["roundpipe-async"]["skipped"]
    # the ratios come from this run's rows; pairs with a row that did not run are left out
    sync, resident = report["systems"]["engine-sync"], report["systems"]["resident"]
    for way in ("steady", "overall"):
        want = sync[f"tokens_per_s_{way}"] / resident[f"tokens_per_s_{way}"]
        assert report["ratios"][f"engine-sync/resident ({way})"] == pytest.approx(want)
    assert not any("roundpipe" in k or k.startswith("engine-async/") for k in report["ratios"])
    assert "| engine-sync |" in done.stdout and f"wrote {out}" in done.stdout


def test_a_child_stops_timing_when_its_share_runs_out_and_says_so() -> None:
    clock = side_by_side.Clock(0.0)
    time.sleep(0.01)
    assert clock.more(0, 20) and clock.more(2, 20)  # at least three steps, whatever the time
    assert not clock.more(3, 20) and clock.cut
    patient = side_by_side.Clock(3600)
    assert patient.more(19, 20) and not patient.more(20, 20) and not patient.cut


def test_ratios_pair_the_engine_with_the_peer_and_the_resident_loop_from_one_run() -> None:
    rows = {
        "engine-async": {"tokens_per_s_steady": 30.0, "tokens_per_s_overall": 25.0},
        "roundpipe-async": {"tokens_per_s_steady": 20.0, "tokens_per_s_overall": 20.0},
        "resident-recompute": {"tokens_per_s_steady": 40.0, "tokens_per_s_overall": 40.0},
        "engine-sync": {"skipped": "no time left in --budget"},
    }
    r = side_by_side.ratios(rows)
    assert r["engine-async/roundpipe-async (steady)"] == 1.5
    assert r["engine-async/roundpipe-async (overall)"] == 1.25
    assert r["engine-async/resident-recompute (steady)"] == 0.75
    assert not any(k.startswith("engine-sync/") for k in r)
