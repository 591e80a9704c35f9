"""Sweeps: trials from a grid or random draws, priced first, queued as jobs naming the sweep,
refused naming the field, cancelled together, judged by the median stopping rule, and run by a
real worker one after another with the best one marked."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.metrics import ListSink
from engine.planner.overheads import START_S, WARMUP_STEPS
from server.kinds import EventKind
from server.services import jobs, sweeps
from server.settings import Settings
from server.worker.tracking import early_stopping
from tests.server.conftest import WorkerProcess
from tests.server.test_plan import cpu_worker_online, padded_tokens, run_measured_job
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


def test_sweep_input_is_taken_as_given_or_refused_naming_the_field_and_the_value(client: TestClient) -> None:
    ds = dataset(client)
    no_validation = job_body(ds)  # no validation data: no trial ever logs loss/val
    random: dict[str, Any] = {"search": "random", "trials": 3}
    refused: list[tuple[dict[str, Any], str, str]] = [
        # an integer field takes whole numbers: 2.7 is not rounded to 3
        ({"parameters": {"hyper.batch_size": [2.7, 4]}}, "parameters.hyper.batch_size", "2.7"),
        (random | {"parameters": {"batch_size": [2, 4, 4.5]}}, "parameters.batch_size", "4.5"),
        (random | {"parameters": {"lora_r": {"min": 2.5, "max": 8}}}, "parameters.lora_r", "2.5"),
        # an interval's min above its max
        (
            random | {"parameters": {"learning_rate": {"min": 0.1, "max": 0.01}}},
            "parameters.learning_rate",
            "min 0.1 is above max 0.01",
        ),
        # a metric no trial logs: the sweep could never name a best trial
        ({"metric": "nonexistent/metric"}, "metric", "'nonexistent/metric'"),
        ({"metric": "dpo/reward_margin"}, "metric", "'dpo/reward_margin'"),  # a DPO metric, an SFT sweep
        ({"metric": "loss/val", "job": no_validation}, "metric", "'loss/val'"),
        ({"metric": "accuracy/val", "job": no_validation}, "metric", "'accuracy/val'"),
    ]
    for over, param, said in refused:
        for route in ("/api/sweeps/plan", "/api/sweeps"):
            r = client.post(route, json=sweep_body(ds) | over)
            assert r.status_code == 422, (over, r.text)
            error = r.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_request", param), (over, error)
            assert said in error["message"] and error["message"].startswith(param), (over, error)
    assert client.get("/api/jobs").json()["data"] == [] and client.get("/api/sweeps").json()["data"] == []
    # what the trials do log is taken: the engine's throughput, a method's own, loss/train without
    # validation data; whole numbers of an integer field, written as floats or not
    taken: list[dict[str, Any]] = [
        {"metric": "throughput/tokens_per_s", "goal": "maximize"},
        {"metric": "accuracy/train", "goal": "maximize"},
        {"metric": "loss/train", "job": no_validation},
        {"parameters": {"batch_size": [2.0, 4]}},
        random
        | {"parameters": {"batch_size": {"min": 2, "max": 4}, "learning_rate": {"min": 0.01, "max": 0.01}}},
    ]
    for over in taken:
        r = client.post("/api/sweeps/plan", json=sweep_body(ds) | over)
        assert r.status_code == 200, (over, r.text)
    drawn = client.post(
        "/api/sweeps/plan",
        json=sweep_body(ds) | random | {"parameters": {"batch_size": {"min": 2, "max": 4}}},
    )
    assert {t["params"]["batch_size"] for t in drawn.json()["trials"]} <= {2, 3, 4}
    # the /v1 extension parses the same sweep (a 400 there, as OpenAI's)
    body = {
        "model": "tiny",
        "training_file": f"file-{ds}",
        "roundhouse": {"engine": {"devices": ["cpu"], "num_microbatches": 1}, "hyper": {"max_steps": 2}},
        "sweep": {"parameters": {"lora_r": [2, 4]}, "metric": "nonexistent/metric"},
    }
    r = client.post("/v1/fine_tuning/sweeps", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "sweep.metric", r.text


def test_a_sweep_is_priced_end_to_end_from_this_box_when_it_ran_the_model(
    client: TestClient, settings: Settings
) -> None:
    ds = dataset(client)
    body = sweep_body(ds)
    # the planner's price: each trial's steps and what it costs besides them (start, model load,
    # data, warm-up, validation, checkpoints), far more than its steps for the tiny model
    priced = client.post("/api/sweeps/plan", json=body).json()
    assert (priced["estimate"], priced["calibrated_from"]) == ("planner", None)
    for trial in priced["trials"]:
        assert trial["eta_s"] == pytest.approx(trial["steps_s"] + trial["overhead_s"])
        assert trial["overhead_s"] > START_S + WARMUP_STEPS * trial["steps_s"] / 2 > trial["steps_s"]
    assert priced["eta_s"] == pytest.approx(sum(t["eta_s"] for t in priced["trials"]))
    assert priced["eta_s"] > 4 * START_S
    one = client.post("/api/plan", json=body["job"] | {"method": {"kind": "lora", "lora_r": 2}}).json()
    assert priced["trials"][0]["overhead_s"] == pytest.approx(one["overheads"]["total_s"])

    # once this box ran the model (a trial of it: 2 steps, 15 s from claim to end), its times do
    worker = cpu_worker_online(client)
    tokens = padded_tokens(client, settings, ds, batch_size=4, max_length=64)
    job = body["job"] | {"hyper": body["job"]["hyper"] | {"learning_rate": 0.1}}
    ran = run_measured_job(
        client, job, worker_id=worker, tokens_per_step=tokens, step_s=[4.0, 0.5], wall_s=15
    )
    measured = client.post("/api/sweeps/plan", json=body).json()
    assert (measured["estimate"], measured["calibrated_from"]) == ("measured", ran)
    for trial in measured["trials"]:
        assert trial["overhead_s"] == 14.0  # 15 s less 2 steady steps of 0.5 s
        assert trial["eta_s"] == pytest.approx(14.0 + trial["steps_s"])
    # the trial it ran again is priced at what it took
    same = next(t for t in measured["trials"] if t["params"] == {"learning_rate": 0.1, "method.lora_r": 4})
    assert same["eta_s"] == pytest.approx(15.0, rel=0.05)
    # the sweep keeps its price, and says where it came from
    sweep = client.post("/api/sweeps", json=body).json()
    assert sweep["plan"]["estimate"] == "measured" and sweep["plan"]["eta_s"] == pytest.approx(
        measured["eta_s"]
    )
    client.post(f"/api/sweeps/{sweep['id']}/cancel")


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
    # the box ran the model: the same sweep priced again comes from the latest trial's measured
    # times, each trial end to end (the planner's steps alone were a thousandth of it)
    again = client.post("/api/sweeps/plan", json=body).json()
    latest = max(done["trials"], key=lambda t: t["finished_at"])
    assert (again["estimate"], again["calibrated_from"]) == ("measured", latest["job_id"])
    took = sum(t["duration_s"] for t in done["trials"])
    assert 0.5 < again["eta_s"] / took < 2, (again, took)


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
