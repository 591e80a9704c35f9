"""Sweeps: trials from a grid or random draws, priced first, queued as jobs naming the sweep,
refused naming the field, cancelled together, judged by the median stopping rule, and run by a
real worker one after another with the best one marked."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.metrics import ListSink
from server.kinds import EventKind
from server.services import jobs, sweeps
from server.settings import Settings
from server.worker.tracking import early_stopping
from tests.server.conftest import WorkerProcess
from tests.utils.jobs import job_body, wait_for

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 5}."},
            {"role": "assistant", "content": str(i % 5)},
        ]
    }
    for i in range(24)
]


def dataset(client: TestClient) -> str:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    r = client.post("/api/datasets", files={"file": ("rows.jsonl", content)})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def sweep_body(dataset_id: str, **over) -> dict:
    body = {
        "name": "lr and rank",
        "job": job_body(dataset_id, eval={"every_steps": 1}, data={"validation_fraction": 0.2}),
        "parameters": {"learning_rate": [0.01, 0.1], "method.lora_r": [2, 4]},
        "metric": "loss/val",
        "goal": "minimize",
    }
    return body | over


def test_a_grid_is_priced_queued_as_tagged_jobs_and_cancelled_together(client: TestClient) -> None:
    ds = dataset(client)
    priced = client.post("/api/sweeps/plan", json=sweep_body(ds))
    assert priced.status_code == 200, priced.text
    plan = priced.json()
    assert [t["params"] for t in plan["trials"]] == [
        {"learning_rate": 0.01, "method.lora_r": 2},
        {"learning_rate": 0.01, "method.lora_r": 4},
        {"learning_rate": 0.1, "method.lora_r": 2},
        {"learning_rate": 0.1, "method.lora_r": 4},
    ]
    assert plan["fits"] and plan["eta_s"] == pytest.approx(sum(t["eta_s"] for t in plan["trials"]))

    r = client.post("/api/sweeps", json=sweep_body(ds))
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert sweep["status"] == "running" and len(sweep["trials"]) == 4
    for trial in sweep["trials"]:
        job = client.get(f"/api/jobs/{trial['job_id']}").json()
        assert job["sweep_id"] == sweep["id"] and job["status"] == "queued"
        assert job["config"]["hyper"]["learning_rate"] == trial["params"]["learning_rate"]
        assert job["config"]["method"]["lora_r"] == trial["params"]["method.lora_r"]
        assert job["name"].startswith(f"lr and rank #{trial['index']} ")
    assert [s["id"] for s in client.get("/api/sweeps").json()["data"]] == [sweep["id"]]

    cancelled = client.post(f"/api/sweeps/{sweep['id']}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert {t["status"] for t in cancelled["trials"]} == {"cancelled"}
    assert client.get("/api/sweeps/nope").status_code == 404


def test_random_draws_are_reproducible_and_bad_sweeps_name_the_field(client: TestClient) -> None:
    ds = dataset(client)
    body = sweep_body(
        ds,
        search="random",
        trials=5,
        seed=7,
        parameters={"learning_rate": {"min": 1e-4, "max": 1e-1, "log": True}, "batch_size": [2, 4]},
    )
    first = client.post("/api/sweeps/plan", json=body).json()["trials"]
    again = client.post("/api/sweeps/plan", json=body).json()["trials"]
    assert [t["params"] for t in first] == [t["params"] for t in again] and len(first) == 5
    assert all(1e-4 <= t["params"]["learning_rate"] <= 1e-1 for t in first)
    assert {t["params"]["batch_size"] for t in first} <= {2, 4}

    for over, param in [
        ({"parameters": {"momentum": [0.9]}}, "parameters.momentum"),
        ({"parameters": {"lora_r": [0, 4]}}, "parameters.lora_r"),
        ({"parameters": {"learning_rate": {"min": 0.1, "max": 1}}}, "parameters.learning_rate"),
        ({"search": "random", "parameters": {"lora_r": [2]}}, "trials"),
        ({"parameters": {}}, "parameters"),
        ({"job": job_body(ds, hyper={"schedule": "sometimes"})}, "job.hyper.schedule"),
        ({"job": job_body("nope")}, "job.dataset_id"),
    ]:
        r = client.post("/api/sweeps", json=sweep_body(ds) | over)
        assert r.status_code in (400, 404, 422), (over, r.text)
        assert r.json()["error"]["param"] == param, (over, r.text)
    assert client.get("/api/jobs").json()["data"] == []  # nothing was queued


def test_the_median_rule_stops_a_trial_clearly_worse_at_the_same_step(client: TestClient) -> None:
    ds = dataset(client)
    body = sweep_body(ds, early_stopping=True, parameters={"learning_rate": [0.01, 0.02, 0.03]})
    sweep = client.post("/api/sweeps", json=body).json()
    a, b, c = (t["job_id"] for t in sweep["trials"])
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        for job_id, losses in ((a, [2.0, 1.5, 1.0]), (b, [2.1, 1.6, 1.2])):
            for step, loss in enumerate(losses, start=1):
                jobs.add_event(
                    session, job_id=job_id, kind=EventKind.METRICS, step=step, data={"loss/val": loss}
                )
        # at step 2 the others' best are 1.5 and 1.6: 1.55 is better than neither's median
        assert sweeps.early_stop(session, job_id=c, step=2, value=1.55) is None
        jobs.add_event(session, job_id=c, kind=EventKind.METRICS, step=2, data={"loss/val": 1.9})
        reason = sweeps.early_stop(session, job_id=c, step=2, value=1.9)
        assert reason == {"step": 2, "metric": "loss/val", "value": 1.9, "median": 1.55, "trials": 2}
        # at a step no other trial reached there is nothing to compare with
        assert sweeps.early_stop(session, job_id=c, step=4, value=9.0) is None
    # the worker's sink: logging a clearly worse value stops the run and says why
    cancel, inner = threading.Event(), ListSink()
    sink = early_stopping(inner, sessions, c, cancel)
    sink.log({"loss/train": 2.0}, 1)
    assert not cancel.is_set()
    sink.log({"loss/val": 1.7}, 1)  # better than the others' 2.0 and 2.1 at step 1
    assert not cancel.is_set()
    sink.log({"loss/val": 1.9}, 3)
    assert cancel.is_set() and [r[0] for r in inner.records] == [1, 1, 3]
    shown = client.get(f"/api/sweeps/{sweep['id']}").json()["trials"][2]
    assert shown["stopped_early"] == {
        "step": 3,
        "metric": "loss/val",
        "value": 1.9,
        "median": 1.1,
        "trials": 2,
    }
    assert early_stopping(inner, sessions, a, threading.Event()) is not inner  # a trial of this sweep
    client.post(f"/api/sweeps/{sweep['id']}/cancel")


@pytest.mark.slow
@pytest.mark.parametrize("worker_settings", ["filesystem"], indirect=True)
def test_a_worker_runs_the_trials_one_after_another_and_the_best_is_marked(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    client = worker_client
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    ds = dataset(client)
    body = sweep_body(ds, parameters={"learning_rate": [0.001, 0.3]})
    sweep = client.post("/api/sweeps", json=body).json()
    done = wait_for(
        lambda: client.get(f"/api/sweeps/{sweep['id']}").json(),
        timeout=300,
        until=lambda s: s["status"] == "finished",
        what="the sweep's trials",
        details=workers[0].tail,
    )
    first, second = done["trials"]
    assert first["status"] == second["status"] == "succeeded", workers[0].tail()
    assert first["finished_at"] <= second["started_at"]  # one after another on one worker
    assert all(t["metric"] is not None and t["duration_s"] > 0 for t in done["trials"])
    best = min(done["trials"], key=lambda t: t["metric"])
    assert done["best_job_id"] == best["job_id"]


def test_the_cli_plans_creates_shows_and_cancels(
    client: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from server.cli import main
    from server.settings import get_settings

    monkeypatch.setenv("ROUNDHOUSE_HOME", str(settings.home))
    monkeypatch.setenv("ROUNDHOUSE_DATABASE_URL", settings.url)
    monkeypatch.setenv("ROUNDHOUSE_HUB_OFFLINE", "1")
    get_settings.cache_clear()
    body = tmp_path / "sweep.json"
    body.write_text(json.dumps(sweep_body(dataset(client), parameters={"lora_alpha": [4, 8]})))
    try:
        assert main(["sweeps", "plan", str(body)]) == 0
        out = capsys.readouterr().out
        assert "#1   lora_alpha=4 " in out and "fits" in out and "2 trials, one after another: ETA" in out
        assert main(["sweeps", "create", str(body)]) == 0
        capsys.readouterr()
        (sweep,) = client.get("/api/sweeps").json()["data"]
        assert main(["sweeps", "show", sweep["id"]]) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"{sweep['id']}  lr and rank  running") and shown.count(" queued ") == 2
        assert main(["sweeps", "cancel", sweep["id"]]) == 0
        assert capsys.readouterr().out.count(" cancelled ") == 3  # the sweep and its two trials
        assert main(["sweeps", "show", "nope"]) == 1
        assert "no sweep 'nope'" in capsys.readouterr().err
    finally:
        get_settings.cache_clear()


def test_the_v1_extension_sweeps_fine_tuning_jobs(client: TestClient) -> None:
    ds = dataset(client)
    body = {
        "model": "tiny",
        "training_file": f"file-{ds}",
        "hyperparameters": {"n_epochs": 1},
        "roundhouse": {"engine": {"devices": ["cpu"], "num_microbatches": 1}, "hyper": {"max_steps": 2}},
        "sweep": {"parameters": {"lora_r": [2, 4]}, "metric": "loss/train"},
    }
    r = client.post("/v1/fine_tuning/sweeps", json=body)
    assert r.status_code == 200, r.text
    sweep = r.json()
    assert [t["params"] for t in sweep["trials"]] == [{"lora_r": 2}, {"lora_r": 4}]
    job = client.get(f"/v1/fine_tuning/jobs/ftjob-{sweep['trials'][1]['job_id']}").json()
    assert job["status"] == "queued" and job["roundhouse"]["job_id"] == sweep["trials"][1]["job_id"]
    assert client.get(f"/v1/fine_tuning/sweeps/{sweep['id']}").json()["id"] == sweep["id"]
    assert client.post(f"/v1/fine_tuning/sweeps/{sweep['id']}/cancel").json()["status"] == "cancelled"
    for over, param in [
        ({"sweep": {"parameters": {"momentum": [1]}}}, "sweep.parameters.momentum"),
        ({"hyperparameters": {"n_epochs": -1}}, "hyperparameters.n_epochs"),
        ({"training_file": "file-nope"}, "training_file"),
    ]:
        r = client.post("/v1/fine_tuning/sweeps", json=body | over)
        assert r.status_code in (400, 404), (over, r.text)
        assert r.json()["error"]["param"] == param, (over, r.text)
