"""Placement and hosts: the queues a worker listens to, a pinned job claimed only on its host (real
worker processes as hosts "a" and "b"), the GPUs grouped per host, and a worker's pull and push
of a job's files through a store that is not its home."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.db import make_engine, session_factory
from server.services import gpus, jobs, placement
from server.settings import Settings
from server.storage import LocalStorage
from server.tables import Worker, now
from server.worker import files
from server.worker.supervisor import supervise
from tests.server.conftest import WorkerProcess
from tests.server.test_worker import dataset
from tests.utils.jobs import job_body, start_job, wait_for_job

# a one-step job with its checkpoint
ONE_STEP: dict[str, Any] = {"hyper": {"max_steps": 1}, "checkpoint": {"every_steps": 1}}


def test_the_queues_of_a_worker_and_of_a_placement() -> None:
    assert placement.worker_queues("rh", host="a", gpus=2) == ["rh", "rh.host.a", "rh.gpus.1", "rh.gpus.2"]
    assert placement.worker_queues("rh", host="cpu", gpus=0) == ["rh", "rh.host.cpu", "rh.gpus.1"]
    assert placement.queue_for("rh", None) == "rh"
    assert placement.queue_for("rh", {"host": None, "gpus": None}) == "rh"
    assert placement.queue_for("rh", {"host": "b", "gpus": 2}) == "rh.host.b"
    assert placement.queue_for("rh", {"host": None, "gpus": 4}) == "rh.gpus.4"
    # a job's queue is one its worker listens to exactly when the worker fits it
    for where in ({"host": "a"}, {"gpus": 2}, {"gpus": 3}, {"host": "b", "gpus": 1}):
        for host, count in (("a", 2), ("b", 1), ("b", 0)):
            listens = placement.queue_for("rh", where) in placement.worker_queues("rh", host=host, gpus=count)
            assert listens == placement.fits(where, host=host, gpus=count) or "host" in where, (where, host)
    assert not placement.fits({"host": "b", "gpus": 2}, host="b", gpus=1)
    assert placement.describe({"host": None, "gpus": 4}) == "a host with 4 GPUs"
    assert placement.describe({"host": "b", "gpus": 1}) == "host b with 1 GPU"


def test_a_job_pinned_to_host_b_is_never_claimed_by_host_a(client: TestClient, settings: Settings) -> None:
    data = dataset(client)
    base = job_body(data)
    r = client.post("/api/jobs", json=base | {"placement": {"host": "b"}})
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["placement"] == {"host": "b", "gpus": None}
    # no worker online: accepted, and the job says what it waits for
    events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
    assert any(e["message"] == "waiting for host b: no online worker has it now" for e in events)
    for bad in ({"host": "a b"}, {"gpus": 0}, {"cores": 2}):
        r = client.post("/api/jobs", json=base | {"placement": bad})
        assert r.status_code == 422, (bad, r.text)
    sessions = session_factory(make_engine(settings.url))
    on_a = settings.model_copy(update={"worker_host": "a", "worker_gpus": 8})
    outcome = supervise(on_a, sessions, job_id=job["id"], worker_id="w@a")
    assert outcome == "not for this worker: the job wants host b"
    assert client.get(f"/api/jobs/{job['id']}").json()["status"] == "queued"
    events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
    assert events[-1]["message"] == "w@a (host a, 8 GPU(s)) cannot run it: waiting for host b"
    with sessions() as session:  # the sweep's requeue keeps it
        assert jobs.claim(session, job_id=job["id"], worker_id="w@b", lease_seconds=0.0)
        time.sleep(0.01)
        assert jobs.sweep(session) == [job["id"]]
        assert jobs.get_job(session, job_id=job["id"]).placement == {"host": "b", "gpus": None}  # type: ignore[union-attr]


def test_gpus_are_grouped_by_host(client: TestClient, settings: Settings) -> None:
    sessions = session_factory(make_engine(settings.url))
    device = {"index": 0, "name": "H200", "utilization": 0.0, "memory_used": 0, "memory_total": 141e9}
    device |= {"temperature": 30.0, "power_w": 80.0}
    with sessions() as session:
        gpus.record(session, worker_id="old@a", hostname="a", devices=[device], cpu={}, message="1 GPU(s)")
        session.get(Worker, "old@a").heartbeat_at = now() - timedelta(hours=1)  # type: ignore[union-attr]
        session.commit()
        gpus.record(
            session,
            worker_id="new@a",
            hostname="a",
            devices=[device, device | {"index": 1}],
            cpu={},
            message="",
        )
        gpus.record(session, worker_id="w@b", hostname="b", devices=[], cpu={}, message="no GPU")
    body = client.get("/api/gpus").json()
    assert [w["worker"] for w in body["data"]] == ["new@a", "old@a", "w@b"]  # per worker, as before
    hosts = {h["hostname"]: h for h in body["hosts"]}
    assert list(hosts) == ["a", "b"]
    assert [w["worker"] for w in hosts["a"]["workers"]] == ["new@a", "old@a"]  # online first
    assert (hosts["a"]["online"], hosts["a"]["gpus"], hosts["b"]["gpus"]) == (True, 2, 0)
    assert hosts["a"]["last_seen"] == body["data"][0]["heartbeat_at"]


class Detached(LocalStorage):
    """A store in another folder than the worker's home, with nothing local to share: an S3 bucket
    as the worker sees it (every read is a copy)."""

    def local_path(self, key: str) -> Path | None:
        return None


def checkpoint(folder: Path, step: int) -> Path:
    path = folder / f"step_{step:06d}"
    (path / "state").mkdir(parents=True)
    (path / "state" / "trainer.json").write_text(f'{{"step": {step}}}')
    (path / "adapter.safetensors").write_bytes(bytes([step]) * 10)
    return path


def test_a_worker_pulls_inputs_into_its_home_and_pushes_checkpoints(tmp_path: Path) -> None:
    store = Detached(tmp_path / "bucket")
    settings = Settings(home=tmp_path / "worker-home", database_url="sqlite://")
    elsewhere = tmp_path / "uploads"
    elsewhere.mkdir()
    (elsewhere / "rows.jsonl").write_text('{"text": "hi"}\n')
    store.put_file("datasets/d1.jsonl", elsewhere / "rows.jsonl")
    model = elsewhere / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    store.put_tree("models/org/tiny", model)
    stored: dict[str, Any] = {
        "model": {"path": "/api-host/models/tiny", "name": "org/tiny"},
        "data": {"train": "datasets/d1.jsonl", "validation": None},
        "output_dir": "runs/j1",
    }
    raw = files.local_config(settings, store, config=stored, base_model="org/tiny")
    home = settings.home.resolve()
    assert raw["data"]["train"] == str(home / "cache" / "datasets" / "d1.jsonl")
    assert raw["model"]["path"] == str(home / "cache" / "models" / "org" / "tiny")
    assert raw["output_dir"] == str(home / "runs" / "j1")
    assert (Path(raw["model"]["path"]) / "config.json").is_file()
    assert stored["data"]["train"] == "datasets/d1.jsonl"  # the row keeps its keys
    with pytest.raises(ValueError, match="roundhouse models push other"):
        files.local_config(settings, store, config=stored, base_model="other")

    # another host stored steps 1 and 2: this one resumes from 2, then saves 3 and 4 (keep_last 2)
    first_host = tmp_path / "host-a" / "checkpoints"
    for step in (1, 2):
        key = files.push_checkpoint(
            store, output_dir="runs/j1", path=checkpoint(first_host, step), keep_last=2
        )
    assert key == "runs/j1/checkpoints/step_000002"
    run = Path(raw["output_dir"])
    stale = checkpoint(run / "checkpoints", 3)  # written here once, never pushed: no row names it
    assert files.pull_checkpoint(store, key=key, folder=run, output_dir="runs/j1")
    assert not stale.exists()
    assert (run / "checkpoints" / "step_000002" / "state" / "trainer.json").read_text() == '{"step": 2}'
    assert not files.pull_checkpoint(store, key=key, folder=run)  # there already
    for step in (3, 4):
        path = checkpoint(run / "checkpoints", step)
        assert store.exists("runs/j1/checkpoints/step_000001") == (step == 3)
        assert files.push_checkpoint(store, output_dir="runs/j1", path=path, keep_last=2) == (
            f"runs/j1/checkpoints/step_{step:06d}"
        )
    names = {k.split("/")[3] for k, _ in store.list("runs/j1/checkpoints")}
    assert names == {"step_000003", "step_000004"}  # the pruned ones are gone from the store
    (run / "train.log").write_text("done\n")
    files.push_log(store, output_dir="runs/j1", folder=run)
    assert (tmp_path / "bucket" / "runs" / "j1" / "train.log").read_text() == "done\n"


def test_with_the_home_as_the_store_nothing_is_copied(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", database_url="sqlite://")
    store = LocalStorage(settings.home)
    store.put_file("datasets/d1.jsonl", Path(__file__))
    run = files.run_folder(settings, "runs/j1")
    path = checkpoint(run / "checkpoints", 1)
    assert files.push_checkpoint(store, output_dir="runs/j1", path=path, keep_last=1) == (
        "runs/j1/checkpoints/step_000001"
    )
    assert files.fetch_file(settings, store, "datasets/d1.jsonl", field="data.train") == str(
        settings.home.resolve() / "datasets" / "d1.jsonl"
    )
    assert not files.pull_checkpoint(store, key="runs/j1/checkpoints/step_000001", folder=run)
    assert not (settings.home / "cache").exists()
    # rows made before keys hold absolute paths: used as they are
    assert files.push_checkpoint(store, output_dir=str(run), path=path, keep_last=1) == str(path)


def test_real_workers_on_two_hosts_take_only_what_fits_them(
    worker_client: TestClient, worker_settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    """Workers "a" (1 GPU slot) and "b" (2) on one machine: a job pinned to b and one asking for 2
    GPUs run on b; one asking for 4 waits, and says so."""
    if worker_settings.redis_url is None:
        pytest.skip("one broker is enough: the queues are the same on the folder transport")
    client = worker_client
    for host, count in (("a", "1"), ("b", "2")):
        worker = WorkerProcess(worker_settings, tmp_path / f"worker-{host}.log")
        worker.env.update(ROUNDHOUSE_WORKER_HOST=host, ROUNDHOUSE_WORKER_GPUS=count)
        workers.append(worker.start())
    data = dataset(client)
    deadline = time.monotonic() + 60
    while {h["hostname"] for h in client.get("/api/gpus").json()["hosts"] if h["online"]} != {"a", "b"}:
        assert time.monotonic() < deadline, "\n".join(w.tail() for w in workers)
        time.sleep(0.2)
    pinned = start_job(client, data, **ONE_STEP, placement={"host": "b"})
    two = start_job(client, data, **ONE_STEP, placement={"gpus": 2})
    four = start_job(client, data, **ONE_STEP, placement={"gpus": 4})
    for job in (pinned, two):
        done = wait_for_job(client, job["id"], {"succeeded", "failed"}, logs=workers)
        assert done["status"] == "succeeded", done["error"]
        events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
        runs_on = [e["data"]["worker"] for e in events if e["data"].get("to") == "running"]
        assert runs_on and all(w.endswith("@b") for w in runs_on), runs_on
    assert client.get(f"/api/jobs/{four['id']}").json()["status"] == "queued"
    events = client.get(f"/api/jobs/{four['id']}/events").json()["data"]
    assert any(e["message"].startswith("waiting for a host with 4 GPUs") for e in events)


def test_migration_0008_adds_the_placement_column_as_declared(database_url: str) -> None:
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from sqlalchemy import inspect

    from server.db import MIGRATIONS
    from server.tables import Base

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    before = ScriptDirectory.from_config(cfg).get_revision("0008").down_revision
    assert isinstance(before, str)
    for step, target in ((command.upgrade, "0008"), (command.downgrade, before), (command.upgrade, "head")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
            assert ("placement" in columns) == (target != before), target
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [d for d in diff if "'jobs'" in repr(d) or "jobs." in repr(d)] == []


def test_the_reconcile_finds_and_resends_a_pinned_job_in_its_host_s_queue(
    client: TestClient, settings: Settings
) -> None:
    from server import queue

    job = start_job(client, dataset(client), placement={"host": "z"})
    folder = settings.broker_dir / "queue"
    pinned = f"*.{settings.queue}.host.z.msg"
    assert len(list(folder.glob(pinned))) == 1 and not list(folder.glob(f"*.{settings.queue}.msg"))
    soon = settings.model_copy(update={"requeue_after_seconds": 0.01})
    time.sleep(0.05)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        assert queue.reconcile(soon, session) == []  # its message waits in host z's queue
        for message in folder.glob(pinned):
            message.unlink()  # the broker lost it
        assert queue.reconcile(soon, session) == [job["id"]]
    assert len(list(folder.glob(pinned))) == 1  # sent again to the same queue


def test_an_evaluation_on_a_host_that_pulls_from_the_store(
    client: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is the API's home seen as a remote one (every read a copy): the evaluating host
    pulls the checkpoint, the dataset and the base model into its own home and puts the result."""
    from engine.config import TrainConfig
    from engine.training.run import train
    from server.services import evaluations
    from server.worker import evaluator
    from server.worker.trainer import DatabaseSink

    data = dataset(client)
    job = start_job(client, data, **ONE_STEP, engine={"devices": ["cpu"], "compute_dtype": "float32"})
    sessions = session_factory(make_engine(settings.url))
    here = LocalStorage(settings.home)
    sink = DatabaseSink(sessions, job["id"], store=here, output_dir=f"runs/{job['id']}", keep_last=2)
    train(TrainConfig.model_validate(job["config"]), sink, models_dir=settings.models_dir)
    r = client.post(f"/api/jobs/{job['id']}/evaluations", json={"dataset_id": data, "max_rows": 2})
    assert r.status_code == 201, r.text

    with sessions() as session:  # the base model's folder on the API host is not on this one
        stored = jobs.get_job(session, job_id=job["id"])
        assert stored is not None
        stored.config = stored.config | {"model": stored.config["model"] | {"path": "/api-host/models/tiny"}}
        session.commit()
    remote = Detached(settings.home)
    monkeypatch.setattr(files, "open_store", lambda _: remote)
    elsewhere = settings.model_copy(update={"home": tmp_path / "evaluating-host"})
    evaluator._evaluate(elsewhere, sessions, r.json()["id"])
    key = f"runs/{job['id']}/checkpoints/step_000001/evaluations/{r.json()['id']}.json"
    with sessions() as session:
        row = evaluations.get(session, evaluation_id=r.json()["id"])
        assert row is not None and row.path == key
        result = evaluations.read_result(row, here)
    assert result is not None and result["evaluation"]["step"] == 1 and result["rows"] == 2
    cache = elsewhere.home.resolve() / "cache"
    assert (cache / "runs" / job["id"] / "checkpoints" / "step_000001").is_dir()  # its export, pulled
    assert (cache / "models" / "tiny" / "config.json").is_file()  # the store's models/tiny/, pulled


def test_a_plan_is_for_one_host_s_gpus(client: TestClient, settings: Settings) -> None:
    from server.services import plans

    sessions = session_factory(make_engine(settings.url))
    device = {"index": 0, "name": "GPU", "utilization": 0.0, "memory_used": 0, "memory_total": 24e9}
    device |= {"temperature": 30.0, "power_w": 80.0}
    big = [device | {"index": i, "memory_total": 80e9} for i in range(4)]
    ram = {"memory_total": 64e9, "cores": 8.0}
    with sessions() as session:
        gpus.record(session, worker_id="w@a", hostname="a", devices=[device], cpu=ram, message="")
        gpus.record(session, worker_id="w@b", hostname="b", devices=big, cpu=ram, message="")
        best = plans.hardware(session, given={}, stale_after=60)
        on_a = plans.hardware(session, given={}, stale_after=60, host="a")
        nowhere = plans.hardware(session, given={}, stale_after=60, host="c")
    # the most GPUs one host has (4, not the 5 of both), and its memory (not the smallest of all)
    assert (best.num_gpus, best.gpu_memory_gb, best.detected[0]) == (4, 80.0, "host b")
    assert (on_a.num_gpus, on_a.gpu_memory_gb, on_a.detected[0]) == (1, 24.0, "host a")
    assert "GPU count" not in nowhere.detected  # no worker there: the defaults, said so by the plan
    body = {"base_model": "tiny", "hyper": {"max_steps": 2}, "placement": {"host": "a"}}
    r = client.post("/api/plan", json=body)
    assert r.status_code == 200, r.text
    assert "host a" in r.json()["assumptions"]["detected"]
