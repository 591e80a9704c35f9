"""No lost job: queued jobs whose broker message vanished are sent again, a submit while the broker
is down is kept and sent later, and a training process killed by a signal (the out-of-memory
killer) is restarted from its last checkpoint up to ``max_retries`` times, to the same weights.

Real ``roundhouse worker`` processes on Redis database 7 (6, 5, ... for the other pytest-xdist
workers; flushed by one test, so nothing else there is touched) and a SQLite file; the tiny model
trains on the CPU."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from server.app import create_app
from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.server.conftest import WorkerProcess
from tests.server.test_worker import dataset
from tests.utils import answers, free_port, xdist_worker
from tests.utils.jobs import FINAL, start_job, states, wait_for_job

REDIS = f"redis://127.0.0.1:6379/{7 - xdist_worker() % 8}"
TIMEOUT_S = 150
# a job killed once it reached step 5 runs this long: long enough that it cannot end first
KILL_STEPS = 120


def _settings(tmp_path: Path, **extra: Any) -> Settings:
    home = tmp_path / "home"
    if not (home / "models" / "tiny").is_dir():
        tiny_model_folder(home / "models" / "tiny")
    values: dict[str, Any] = {
        "home": home,
        "database_url": f"sqlite:///{tmp_path / 'roundhouse.db'}",
        "redis_url": REDIS,
        "queue": f"t-{uuid.uuid4().hex}",
        "lease_seconds": 3.0,
        "telemetry_seconds": 0.5,
        "requeue_after_seconds": 2.0,
    }
    return Settings(**(values | extra))


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    if not answers("127.0.0.1", 6379):
        pytest.skip("no Redis server answers on 127.0.0.1:6379 (make test starts one)")
    return _settings(tmp_path)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    app = create_app(settings)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {app.state.first_key}"
        yield c


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.end()


def events(client: TestClient, job_id: str) -> list[dict[str, Any]]:
    return list(client.get(f"/api/jobs/{job_id}/events", params={"limit": 1000}).json()["data"])


def claims(client: TestClient, job_id: str) -> int:
    """How many times a worker took the job (state events into running)."""
    return sum(1 for e in events(client, job_id) if e["kind"] == "state" and e["data"]["to"] == "running")


def logged(client: TestClient, job_id: str, key: str) -> list[dict[str, Any]]:
    """The job's log events whose data carry ``key``."""
    return [e for e in events(client, job_id) if e["kind"] == "log" and key in e["data"]]


def trainer_of(worker: WorkerProcess) -> psutil.Process:
    (trainer,) = [p for p in worker.descendants() if "server.worker.trainer" in p.cmdline()]
    return trainer


def same_weights(job: dict[str, Any], settings: Settings, reference_dir: Path, step: int) -> None:
    """The job's final adapter is bitwise the one of the same config trained without a stop."""
    from engine.config import TrainConfig
    from engine.training.run import train

    reference = TrainConfig.model_validate(job["config"] | {"output_dir": str(reference_dir)})
    train(reference, models_dir=settings.models_dir)
    name = f"step_{step:06d}/adapter_model.safetensors"
    ours = load_file(Path(job["config"]["output_dir"]) / "checkpoints" / name)
    theirs = load_file(reference_dir / "checkpoints" / name)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def drop_messages(settings: Settings) -> None:
    """Lose the queue's waiting messages, as a restarted Redis without persistence does."""
    import redis

    if settings.redis_url:
        redis.Redis.from_url(settings.redis_url).delete(settings.queue)
    else:
        for path in (settings.broker_dir / "queue").glob("*.msg"):
            path.unlink()


@pytest.mark.parametrize("broker", ["redis", "filesystem"])
def test_the_reconcile_sends_a_job_again_only_when_no_worker_took_it_and_its_message_is_gone(
    broker: str, tmp_path: Path
) -> None:
    from server import queue
    from server.services import jobs

    if broker == "redis" and not answers("127.0.0.1", 6379):
        pytest.skip("no Redis server answers on 127.0.0.1:6379")
    settings = _settings(tmp_path, redis_url=REDIS if broker == "redis" else None)
    app = create_app(settings)
    sessions = app.state.sessions
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {app.state.first_key}"
        job_id = start_job(client, dataset(client))["id"]
        assert queue.waiting(settings) == {job_id}
        with sessions() as session:
            assert queue.reconcile(settings, session) == []  # not due yet
        time.sleep(settings.requeue_after_seconds + 0.1)
        with sessions() as session:
            assert queue.reconcile(settings, session) == []  # due, but its message still waits
            drop_messages(settings)
            assert queue.reconcile(settings, session) == [job_id]  # due and lost: sent again
            assert queue.reconcile(settings, session) == []  # just sent
        assert queue.waiting(settings) == {job_id}
        assert [e["data"]["sends"] for e in logged(client, job_id, "sends")] == [2]
        # a worker takes it (and the broker's message goes with it): it is not sent again
        drop_messages(settings)
        time.sleep(settings.requeue_after_seconds + 0.1)
        with sessions() as session:
            assert jobs.claim(session, job_id=job_id, worker_id="w", lease_seconds=0.0)
            assert queue.reconcile(settings, session) == []
            # its worker vanishes: the sweep interrupts it and the reconcile sends it at once
            assert jobs.sweep(session) == [job_id]
            patient = settings.model_copy(update={"requeue_after_seconds": 3600.0})
            assert queue.reconcile(patient, session) == [job_id]
        assert queue.waiting(settings) == {job_id}
        assert [e["data"]["sends"] for e in logged(client, job_id, "sends")] == [2, 3]
        assert logged(client, job_id, "sends")[-1]["message"].startswith("requeued")
        # a cancelled job is never sent again
        client.post(f"/api/jobs/{job_id}/cancel")
        drop_messages(settings)
        with sessions() as session:
            assert queue.reconcile(patient.model_copy(update={"requeue_after_seconds": 0.001}), session) == []


def test_migration_0004_adds_the_send_and_retry_columns_as_declared(database_url: str) -> None:
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
    added = {"sent_at", "sends", "retries"}
    for step, target in ((command.upgrade, "0004"), (command.downgrade, "0003"), (command.upgrade, "0004")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
            assert added & columns == (added if target == "0004" else set()), target
    with engine.begin() as conn:  # the later migrations too (their tables refer to jobs)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [d for d in diff if "'jobs'" in repr(d) or "jobs." in repr(d)] == []


@pytest.mark.slow
def test_queued_jobs_survive_a_flushed_broker_and_run_exactly_once(
    client: TestClient, settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    import redis

    # the sweep re-sends a job no worker claimed within requeue_after_seconds: on a loaded machine
    # the first claim of a worker just started may take longer than the file's 2 s
    settings = settings.model_copy(update={"requeue_after_seconds": 6.0})
    first = WorkerProcess(settings, tmp_path / "worker-1.log").start()
    workers.append(first)
    ds = dataset(client)
    done = start_job(client, ds)
    done = wait_for_job(client, done["id"], FINAL, timeout=TIMEOUT_S, logs=workers)
    assert done["status"] == "succeeded", done["error"]
    assert first.stop(), "the idle worker did not stop on SIGTERM"
    # queued while no worker runs: their messages wait in Redis, and then Redis loses them
    waiting = [start_job(client, ds)["id"] for _ in range(3)]
    broker = redis.Redis.from_url(REDIS)
    # one message each at least: on a loaded machine the sweep may already have re-sent one whose
    # requeue_after_seconds passed (a further copy; the claim keeps each job to one run)
    assert broker.llen(settings.queue) >= 3
    broker.flushdb()
    second = WorkerProcess(settings, tmp_path / "worker-2.log").start()
    workers.append(second)
    for job_id in waiting:
        job = wait_for_job(client, job_id, FINAL, timeout=TIMEOUT_S, logs=workers)
        assert job["status"] == "succeeded", (job["error"], second.tail())
        assert job["attempts"] == 1 and claims(client, job_id) == 1
        assert states(client, job_id) == ["validating", "queued", "running", "succeeded"]
        # sent again once the lost message was noticed (a job still waiting behind the others
        # on a slow machine may be sent a further time: the claim keeps it to one run)
        resent = logged(client, job_id, "sends")
        assert resent and resent[0]["data"]["sends"] == 2, resent
    # the job that ran before is not sent or run again
    assert client.get(f"/api/jobs/{done['id']}").json()["attempts"] == 1
    assert logged(client, done["id"], "sends") == [] and claims(client, done["id"]) == 1


def test_a_submit_while_the_broker_is_down_is_kept_and_sent_later(
    settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    down = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/7"})
    app = create_app(down)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {app.state.first_key}"
        job = start_job(client, dataset(client))
        assert job["status"] == "queued"
        (pending,) = logged(client, job["id"], "send_pending")
        assert "job queue is unreachable" in pending["message"]
        # a worker on the broker that answers (the same database) sends and runs it
        workers.append(WorkerProcess(settings, tmp_path / "worker.log").start())
        job = wait_for_job(client, job["id"], FINAL, timeout=TIMEOUT_S, logs=workers)
        assert job["status"] == "succeeded", (job["error"], workers[0].tail())
        assert job["attempts"] == 1 and claims(client, job["id"]) == 1
        assert [e["data"]["sends"] for e in logged(client, job["id"], "sends")] == [1]


@pytest.mark.slow
def test_a_training_process_killed_by_a_signal_resumes_to_the_same_weights(
    client: TestClient, settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    workers.append(worker)
    ds = dataset(client)
    job = start_job(client, ds, hyper={"max_steps": KILL_STEPS}, checkpoint={"every_steps": 4})
    wait_for_job(client, job["id"], lambda j: j["step"] >= 5, timeout=TIMEOUT_S, logs=workers)
    assert client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"], "no checkpoint yet"
    trainer_of(worker).kill()  # as the kernel's out-of-memory killer does
    killed_at = client.get(f"/api/jobs/{job['id']}").json()["step"]
    assert killed_at < KILL_STEPS, "the job finished before its training process was killed"
    job = wait_for_job(client, job["id"], FINAL, timeout=TIMEOUT_S, logs=workers)
    assert job["status"] == "succeeded", (job["error"], worker.tail())
    # the same claim: the worker restarted its training process, the broker was not involved
    assert job["attempts"] == 1 and claims(client, job["id"]) == 1
    (retry,) = logged(client, job["id"], "retry")
    assert retry["data"]["retry"] == 1 and retry["data"]["signal"] == "SIGKILL", retry
    assert 4 <= retry["data"]["checkpoint_step"] <= killed_at
    (resumed,) = [e for e in events(client, job["id"]) if e["kind"] == "resume"]
    assert resumed["data"]["step"] == retry["data"]["checkpoint_step"]
    same_weights(job, settings, tmp_path / "reference", KILL_STEPS)

    # an error inside the run would only repeat: it fails at once, without a retry
    broken = start_job(client, ds, data={"format": "text"})
    broken = wait_for_job(client, broken["id"], FINAL, timeout=TIMEOUT_S, logs=workers)
    assert broken["status"] == "failed" and "text" in broken["error"], broken["error"]
    assert logged(client, broken["id"], "retry") == []


def test_with_no_retries_a_killed_training_process_fails_its_job_with_the_reason(
    client: TestClient, settings: Settings, workers: list[WorkerProcess], tmp_path: Path
) -> None:
    worker = WorkerProcess(settings.model_copy(update={"max_retries": 0}), tmp_path / "worker.log")
    workers.append(worker.start())
    job = start_job(client, dataset(client), hyper={"max_steps": 400}, checkpoint={"every_steps": 4})
    wait_for_job(client, job["id"], lambda j: j["step"] >= 5, timeout=TIMEOUT_S, logs=workers)
    (saved, *_) = client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"]
    trainer_of(worker).kill()
    job = wait_for_job(client, job["id"], FINAL, timeout=TIMEOUT_S, logs=workers)
    assert job["status"] == "failed", job
    assert "killed by SIGKILL (out of host memory?) 1 time" in job["error"], job["error"]
    found = re.search(r"last checkpoint step (\d+)", job["error"])
    assert found is not None and int(found[1]) >= saved["step"], job["error"]
    assert logged(client, job["id"], "retry") == []
