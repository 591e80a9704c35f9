"""``/api/jobs/{id}/evaluations``: the 4xx answers naming their parameter, a real worker scoring a
trained job's checkpoint (the result file in the checkpoint folder, the same figures as the engine
gives in process), and evaluations of a vanished worker requeued when a worker starts."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.services import checkpoints, datasets, evaluations
from server.settings import Settings
from server.storage import open_storage
from server.tables import now
from tests.server.conftest import WorkerProcess
from tests.server.test_worker import dataset
from tests.utils.jobs import start_job, tails, wait_for, wait_for_job

TIMEOUT_S = 180


def recorded_checkpoint(client: TestClient, step: int) -> tuple[str, str]:
    """A queued job (no worker runs it here) with a checkpoint folder recorded at ``step``; and a
    dataset id."""
    rows = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(8)]
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    ds = client.post("/api/datasets", files={"file": ("rows.jsonl", content)}).json()
    job = start_job(client, ds["id"])
    folder = Path(job["config"]["output_dir"]) / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=step, path=str(folder), kind="adapter", metrics={})
    return job["id"], ds["id"]


def error_of(r: Any) -> tuple[int, str | None]:
    return r.status_code, r.json()["error"]["param"]


def test_refusals_name_their_parameter(client: TestClient) -> None:
    job_id, dataset_id = recorded_checkpoint(client, step=3)
    url = f"/api/jobs/{job_id}/evaluations"
    body = {"dataset_id": dataset_id}
    assert error_of(client.post("/api/jobs/nojob/evaluations", json=body)) == (404, "job_id")
    assert error_of(client.post(url, json=body | {"checkpoint": 7})) == (404, "checkpoint")
    assert error_of(client.post(url, json={"dataset_id": "nodata"})) == (404, "dataset_id")
    assert error_of(client.post(url, json=body | {"max_rows": 0})) == (422, "max_rows")
    assert error_of(client.post(url, json=body | {"checkpoint": "first"}))[0] == 422
    assert error_of(client.post(url, json={})) == (422, "dataset_id")
    assert error_of(client.get(f"{url}/noeval")) == (404, "evaluation_id")

    other = start_job(client, dataset_id)
    r = client.post(f"/api/jobs/{other['id']}/evaluations", json=body)
    assert error_of(r) == (409, "checkpoint") and "no checkpoint yet" in r.json()["error"]["message"]

    r = client.post(url, json=body | {"checkpoint": "latest", "max_rows": 4})
    assert r.status_code == 201, r.text
    made = r.json()
    assert (made["step"], made["status"], made["max_rows"], made["metrics"]) == (3, "queued", 4, {})
    assert [e["id"] for e in client.get(url).json()["data"]] == [made["id"]]
    detail = client.get(f"{url}/{made['id']}").json()
    assert (detail["samples"], detail["stored"]) == ([], False)
    assert client.get(f"/api/jobs/{other['id']}/evaluations/{made['id']}").status_code == 404  # not its job


def test_evaluations_of_a_vanished_worker_are_requeued(client: TestClient) -> None:
    job_id, dataset_id = recorded_checkpoint(client, step=1)
    url = f"/api/jobs/{job_id}/evaluations"
    ids = [client.post(url, json={"dataset_id": dataset_id}).json()["id"] for _ in range(3)]
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        assert evaluations.claim(session, evaluation_id=ids[0], worker_id="gone@host")
        assert evaluations.claim(session, evaluation_id=ids[1], worker_id="me@host")
        assert not evaluations.claim(session, evaluation_id=ids[1], worker_id="other@host")  # taken
        queued = evaluations.requeue_abandoned(
            session, worker_id="me@host", silent_before=now() - timedelta(1)
        )
    assert sorted(queued) == sorted(ids)  # gone@host never beat; me@host just started
    with sessions() as session:
        assert evaluations.claim(session, evaluation_id=ids[2], worker_id="me@host")
        assert evaluations.finish(session, evaluation_id=ids[2], worker_id="me@host", error="boom")
        assert not evaluations.finish(session, evaluation_id=ids[2], worker_id="me@host", error="again")
    assert client.get(f"{url}/{ids[2]}").json()["status"] == "failed"


def test_a_worker_evaluates_a_trained_checkpoint(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    from engine.inference.evaluate import evaluate_checkpoint

    client = worker_client
    if worker_settings.redis_url is None:
        pytest.skip("the folder transport is covered by the browser test; one broker is enough here")
    workers.append(WorkerProcess(worker_settings, tmp_path / "worker.log").start())
    data = dataset(client)
    job = start_job(client, data)
    job = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
    assert job["status"] == "succeeded", job["error"]

    url = f"/api/jobs/{job['id']}/evaluations"
    r = client.post(url, json={"dataset_id": data, "max_rows": 6, "max_new_tokens": 4, "num_samples": 3})
    assert r.status_code == 201, r.text
    evaluation = f"{url}/{r.json()['id']}"
    done = wait_for(
        lambda: client.get(evaluation).json(),
        until={"succeeded", "failed"},
        timeout=TIMEOUT_S,
        what=f"evaluation {evaluation}",
        details=lambda: tails(workers),
    )
    assert done["status"] == "succeeded", (done["error"], workers[0].tail())
    assert done["step"] == 2 and done["stored"]
    metrics = done["metrics"]
    assert metrics["rows"] == 6 and metrics["label_tokens"] > 0 and metrics["device"] in ("cpu", "cuda:0")
    assert metrics["exact_match_rows"] == 6  # every answer is one short number
    assert [(s["line"], s["reference"]) for s in done["samples"]] == [(1, "0"), (2, "1"), (3, "2")]
    assert all(s["prompt"].startswith("Count to") for s in done["samples"])

    folder = Path(job["config"]["output_dir"]) / "checkpoints" / "step_000002"
    stored = json.loads((folder / "evaluations" / f"{done['id']}.json").read_text())
    assert stored["samples"] == done["samples"] and stored["evaluation"]["step"] == 2
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        found = datasets.get_dataset(session, dataset_id=data)
        assert found is not None
        rows_path = open_storage(worker_settings).local_path(found.path)  # a key in the store
    again = evaluate_checkpoint(
        folder,
        rows_path,
        base=worker_settings.models_dir / "tiny",
        max_rows=6,
        max_new_tokens=4,
        samples=3,
        max_length=64,
        device="cpu",
    )
    assert again["loss"] == pytest.approx(metrics["loss"], rel=1e-6)
    assert again["samples"] == done["samples"]
    assert [e["id"] for e in client.get(url).json()["data"]] == [done["id"]]


def test_migration_0005_adds_the_evaluations_table_as_declared(database_url: str) -> None:
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from server.db import MIGRATIONS, make_engine
    from server.tables import Base

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    for step, target in ((command.upgrade, "0005"), (command.downgrade, "0004"), (command.upgrade, "0005")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            assert ("evaluations" in inspect(conn).get_table_names()) == (target == "0005"), target
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [d for d in diff if "evaluations" in repr(d)] == []
