"""PostgreSQL restarted under the service: its server stopped at once (``pg_ctl stop -m
immediate``: every server process quits, the connections cut, no shutdown checkpoint, as in a
crash) and started again on the same port, while a job trains and while requests arrive.

- Mid-job: a real ``roundhouse worker`` trains a job through two outages, each longer than a
  lease and lasting until the job has written a new checkpoint on disk (it trained on while the
  database was away). The job ends ``succeeded`` on its first attempt, on the same worker process
  and training process; every step's metrics are there exactly once, every checkpoint event once,
  the progress (step, trained tokens) is the run's.
- Mid-request: an upload cut between its key check and its row (the database stops while the
  file is validated) answers 503 and leaves no file in the store; while the database is down,
  reads, writes and ``/api/health`` answer 503 ``database_unavailable`` with ``Retry-After``
  within seconds; once it is back the same API process answers 200.

Real processes: a PostgreSQL cluster of the test's own (``tests.utils.postgres_server``; the
machine's shared server on 5432 is never touched), Redis, ``roundhouse serve`` and
``roundhouse worker`` with its training child. The training process's kept writes
(``server.worker.writes``) are also tested alone, on SQLite and the shared PostgreSQL, with the
one fault a restart makes only by chance: a commit that went through whose answer was lost."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.server.conftest import WorkerProcess, _redis_url
from tests.server.test_multihost import environment
from tests.server.test_worker import ROWS
from tests.utils import Process, free_port, roundhouse
from tests.utils.jobs import FINAL, start_job, wait_for, wait_for_job
from tests.utils.postgres_server import PostgresServer, postgres_server, why_not

LEASE_S = 3.0
# an outage outlasts a lease: the running job's lease runs out while the database is down
OUTAGE_MIN_S = LEASE_S + 1.0
OUTAGES = 2
# an idle machine trains the tiny model at 20 to 30 steps a second (the writes included): the
# two outages, and the catching up after each, take about 300 steps there
STEPS, EVERY = 2000, 10
# how long a request may take while the database is down (a refused connection is immediate)
ANSWER_S = 5.0
# the upload cut mid-request: its validation (about 20 MB/s) leaves seconds to stop the database
BIG_UPLOAD_ROWS = 8000 * len(ROWS)


@dataclass
class Service:
    postgres: PostgresServer
    settings: Settings
    api: Process
    http: httpx.Client

    def logs(self, *others: Process) -> str:
        parts = [f"--- api\n{self.api.tail()}", f"--- postgres\n{self.postgres.tail()}"]
        return "\n".join(parts + [f"--- {p.log.name}\n{p.tail()}" for p in others])


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    """A throw-away PostgreSQL, the API as a real process on it (migrated, with a key) and Redis."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    redis = _redis_url()
    if redis is None:
        pytest.skip("no Redis server answers (make test starts one)")
    home = tmp_path / "home"
    tiny_model_folder(home / "models" / "tiny")
    with postgres_server() as postgres:
        settings = Settings(
            home=home,
            database_url=postgres.url,
            redis_url=redis,
            queue=f"t-{uuid.uuid4().hex}",
            lease_seconds=LEASE_S,
            telemetry_seconds=0.5,
            requeue_after_seconds=2.0,
            hub_offline=True,
            port=free_port(),
        )
        env = environment(settings)
        made = subprocess.run(
            roundhouse("keys", "create"), env=env, capture_output=True, text=True, timeout=120
        )
        assert made.returncode == 0, made.stderr
        key = made.stdout.strip()
        serve = roundhouse("serve", "--host", "127.0.0.1", "--port", str(settings.port))
        api = Process(serve, env=env, log=tmp_path / "api.log").start()
        base = f"http://127.0.0.1:{settings.port}"
        try:
            api.wait_for_http(f"{base}/api/health", timeout=90)
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                yield Service(postgres, settings, api, http)
        finally:
            api.stop(grace=20)
            api.kill_group()


def _jsonl(rows: int) -> bytes:
    lines = [json.dumps(r) + "\n" for r in ROWS]
    return "".join(lines[i % len(lines)] for i in range(rows)).encode()


def _unavailable(response: httpx.Response, took: float) -> None:
    """The answer of a request made while the database is down: 503 ``database_unavailable``."""
    assert response.status_code == 503, (response.status_code, response.text)
    assert response.json()["error"]["code"] == "database_unavailable", response.text
    assert response.headers.get("Retry-After", "").isdigit(), response.headers
    assert took < ANSWER_S, f"{response.request.url} took {took:.1f} s"


def _timed(http: httpx.Client, method: str, url: str, **kwargs: Any) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = http.request(method, url, **kwargs)
    return response, time.monotonic() - started


def _requests_while_down(http: httpx.Client) -> None:
    """A read, a write and the health check while the database is down: 503 each, quickly."""
    _unavailable(*_timed(http, "GET", "/api/jobs"))
    _unavailable(*_timed(http, "POST", "/api/datasets", files={"file": ("small.jsonl", _jsonl(48))}))
    health, took = _timed(http, "GET", "/api/health")
    _unavailable(health, took)
    assert "database" in health.json()["error"]["message"], health.text


def _back(service: Service) -> None:
    """After the start: the same API process answers 200 again (within seconds)."""
    wait_for(
        lambda: service.http.get("/api/jobs").status_code,
        until=lambda status: status == 200,
        timeout=30,
        what="GET /api/jobs answering 200 after the database started again",
        details=service.logs,
    )
    assert service.http.get("/api/health").status_code == 200
    assert service.api.running()


def _events(http: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    """Every event of the job, page by page."""
    out: list[dict[str, Any]] = []
    after: int | None = 0
    while after is not None:
        page = http.get(f"/api/jobs/{job_id}/events", params={"after": after, "limit": 1000}).json()
        out += page["data"]
        after = page["next_after"]
    return out


def _latest_on_disk(folder: Path) -> int:
    """The step of the newest complete checkpoint in the run's folder (0: none)."""
    from engine.training.checkpoint_layout import latest

    found = latest(folder) if folder.is_dir() else None
    return found[0] if found else 0


@pytest.mark.slow
def test_a_database_restart_mid_job_loses_no_progress_and_the_worker_trains_on(
    service: Service, tmp_path: Path
) -> None:
    http, postgres = service.http, service.postgres
    upload = http.post("/api/datasets", files={"file": ("rows.jsonl", _jsonl(len(ROWS)))})
    assert upload.status_code == 201, upload.text
    job = start_job(
        http,
        upload.json()["id"],
        hyper={"max_steps": STEPS},
        checkpoint={"every_steps": EVERY, "keep_last": 3},
    )
    job_id = job["id"]
    folder = Path(job["config"]["output_dir"]) / "checkpoints"
    worker = WorkerProcess(service.settings, tmp_path / "worker.log").start()
    try:
        job = wait_for_job(http, job_id, lambda j: j["step"] >= EVERY, logs=lambda: service.logs(worker))
        (trainer,) = [p for p in worker.descendants() if "server.worker.trainer" in p.cmdline()]
        outages: list[tuple[datetime, datetime]] = []
        steps: list[tuple[int, int]] = []  # the newest checkpoint on disk at each stop and start
        for outage in range(OUTAGES):
            postgres.stop("immediate")
            stopped, at_stop, since = time.monotonic(), _latest_on_disk(folder), datetime.now(UTC)
            _requests_while_down(http)
            # the job trains on: a checkpoint newer than the one on disk at the stop
            wait_for(
                lambda stopped=stopped: (_latest_on_disk(folder), time.monotonic() - stopped),
                until=lambda seen, at_stop=at_stop: seen[0] > at_stop and seen[1] >= OUTAGE_MIN_S,
                timeout=180,
                what=f"a new checkpoint on disk during outage {outage}",
                details=lambda: service.logs(worker),
            )
            trained_to = _latest_on_disk(folder)
            assert trained_to < STEPS, f"the job ended during outage {outage}: make STEPS larger"
            outages.append((since, datetime.now(UTC)))
            postgres.start()
            steps.append((at_stop, trained_to))
            _back(service)
            # the writes kept while it was down arrive: the job's step passes the one trained to
            wait_for_job(
                http, job_id, lambda j, to=trained_to: j["step"] >= to, logs=lambda: service.logs(worker)
            )
            assert trainer.is_running(), f"the training process {trainer.pid} ended in outage {outage}"
        job = wait_for_job(http, job_id, FINAL, timeout=600, logs=lambda: service.logs(worker))
        assert worker.running(), "the worker process ended"
    finally:
        worker.stop(grace=20)
        worker.kill_group()
    assert job["status"] == "succeeded" and job["step"] == STEPS, (job, service.logs(worker))
    assert job["attempts"] == 1, job  # never requeued, never restarted
    events = _events(http, job_id)
    went = [e["data"]["to"] for e in events if e["kind"] == "state"]
    assert went == ["validating", "queued", "running", "succeeded"], went

    # every step's metrics exactly once: the engine's (loss) and the run's (progress)
    metrics = http.get(f"/api/jobs/{job_id}/metrics", params={"keys": ["loss/train", "progress/step"]})
    series = metrics.json()["data"]
    for key in ("loss/train", "progress/step"):
        assert [p["step"] for p in series[key]] == list(range(1, STEPS + 1)), key
    assert [p["value"] for p in series["progress/step"]] == list(range(1, STEPS + 1))
    # and every event once: no write kept in memory was written twice
    written = [(e["kind"], e["step"], e["message"], json.dumps(e["data"], sort_keys=True)) for e in events]
    twice = {w for w in written if written.count(w) > 1 and w[0] != "telemetry"}
    assert not twice, sorted(twice)[:5]
    saved = [e["data"]["step"] for e in events if e["kind"] == "checkpoint"]
    assert saved == list(range(EVERY, STEPS + 1, EVERY)), saved
    assert not [e for e in events if e["kind"] == "resume"]
    rows = http.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
    assert [c["step"] for c in rows] == [STEPS - 2 * EVERY, STEPS - EVERY, STEPS], rows
    # the trained tokens: each step's batch counted once
    tokens = http.get(f"/api/jobs/{job_id}/metrics", params={"keys": ["tokens/batch"]}).json()["data"]
    trained = http.get(f"/v1/fine_tuning/jobs/{job_id}").json()["trained_tokens"]
    assert trained == sum(int(p["value"]) for p in tokens["tokens/batch"])
    # the metrics logged while the database was down were kept, and keep the time they were made
    times = [datetime.fromisoformat(p["time"]) for p in series["loss/train"]]
    for since, until in outages:
        assert any(since < t < until for t in times), (since, until)
    log = (Path(job["config"]["output_dir"]) / "train.log").read_text()
    # (the run may have caught up with its kept writes only after the second outage, or at its end)
    kept, written = log.count("keeping the run's writes"), log.count("kept writes written")
    assert 1 <= kept <= OUTAGES and written == kept, log[-3000:]
    print(f"{OUTAGES} outages; the newest checkpoint on disk at each stop and start: {steps}")


@pytest.mark.slow
def test_a_database_restart_mid_request_answers_503_and_the_same_api_recovers(
    service: Service, tmp_path: Path
) -> None:
    http, postgres, settings = service.http, service.postgres, service.settings
    pid = service.api.pid
    incoming = settings.cache_dir / "incoming"
    big = _jsonl(BIG_UPLOAD_ROWS)
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(http.post("/api/datasets", files={"file": ("big.jsonl", big)}))

    cut, stored_whole = None, 0
    for _ in range(3):  # a machine so fast that the upload was stored before the stop: again
        answers.clear()
        poster = threading.Thread(target=post)
        poster.start()
        # past the key check: the upload's temporary file is being written or validated
        wait_for(
            lambda: list(incoming.glob(".incoming-*")) if incoming.is_dir() else [],
            timeout=60,
            interval=0.01,
            what="the upload's temporary file",
        )
        postgres.stop("immediate")
        poster.join(timeout=60)
        assert not poster.is_alive(), "the upload hangs while the database is down"
        (answer,) = answers
        if answer.status_code != 201:
            cut = answer
            break
        stored_whole += 1
        postgres.start()
        _back(service)
    assert cut is not None, "the upload was stored before the database stopped, 3 times"
    print(f"the upload was cut mid-request on try {stored_whole + 1}")
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "database_unavailable", cut.text
    # nothing of it stays: no dataset file in the store, no temporary file
    stored = [p for p in settings.datasets_dir.rglob("*") if p.is_file()]
    assert len(stored) == stored_whole, stored  # only the uploads stored whole before a stop
    assert list(incoming.glob(".incoming-*")) == []
    _requests_while_down(http)

    postgres.start()
    _back(service)
    assert service.api.pid == pid
    small = http.post("/api/datasets", files={"file": ("small.jsonl", _jsonl(48))})
    assert small.status_code == 201, small.text
    listed = http.get("/api/datasets").json()["data"]
    assert len(listed) == stored_whole + 1 and small.json()["id"] in {d["id"] for d in listed}
    on_disk = {p.parent.name for p in settings.datasets_dir.rglob("*") if p.is_file()}
    assert on_disk == {d["id"] for d in listed}, on_disk  # every file has its row, every row its file


class _Cut:
    """Sessions of ``sessions`` that fail as a server that went away makes them fail: every query
    and commit while ``down``; with ``lose`` (a count), the next commits go through and the server
    goes down before their answer comes back."""

    def __init__(self, sessions: Any) -> None:
        self.sessions, self.down, self.lose = sessions, False, 0
        self.refused = 0  # queries and commits refused while down

    def __call__(self) -> Any:
        session = self.sessions()
        commit, scalar = session.commit, session.scalar

        def cut_commit() -> None:
            if self.down:
                self.refused += 1
                session.rollback()
                raise _disconnect()
            commit()
            if self.lose:
                self.lose -= 1
                self.down = True
                raise _disconnect()

        def cut_scalar(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                self.refused += 1
                raise _disconnect()
            return scalar(*args, **kwargs)

        session.commit, session.scalar = cut_commit, cut_scalar
        return session


def _disconnect() -> Exception:
    from sqlalchemy.exc import OperationalError

    cause = Exception("server closed the connection unexpectedly")
    return OperationalError("COMMIT", {}, cause, connection_invalidated=True)


def _metrics(job_id: str, step: int) -> Any:
    from server.kinds import EventKind
    from server.services import jobs
    from server.worker.writes import Write

    def apply(session: Any, at: datetime) -> Any:
        event = jobs.add_event(
            session, job_id=job_id, kind=EventKind.METRICS, step=step, data={"loss/train": step}, commit=False
        )
        event.created_at = at
        return event

    return Write(apply, EventKind.METRICS)


def test_writes_whose_commit_answer_was_lost_are_not_written_again(
    app_and_key: tuple[Any, str], client: Any
) -> None:
    from server.worker.writes import Writes
    from tests.server.test_worker import dataset

    app, _ = app_and_key
    job_id = start_job(client, dataset(client))["id"]
    cut = _Cut(app.state.sessions)
    writes = Writes(cut, job_id)
    writes.write(_metrics(job_id, 1))  # made at once
    cut.lose = 1
    writes.write(_metrics(job_id, 2))  # committed, its answer lost: kept, looked for before a retry
    for step in (3, 4, 5):  # kept while the database is down, after it
        writes.write(_metrics(job_id, step))
    assert len(writes.kept) == 4
    cut.lose, cut.down = 1, False  # 2 is found; 3 to 5 made in one transaction, its answer lost
    wait_for(lambda: cut.lose, until=lambda left: left == 0, timeout=30, what="the kept writes' try")
    assert len(writes.kept) == 3
    cut.down = False  # 3 to 5 are found
    assert writes.drain(timeout=60) == 0
    writes.write(_metrics(job_id, 6))  # made at once again
    assert not writes.kept
    series = client.get(f"/api/jobs/{job_id}/metrics", params={"keys": ["loss/train"]}).json()["data"]
    assert [p["step"] for p in series["loss/train"]] == [1, 2, 3, 4, 5, 6]
    times = [datetime.fromisoformat(p["time"]) for p in series["loss/train"]]
    assert times == sorted(set(times))  # each dated when it was made, in order


def test_a_write_kept_behind_one_whose_commit_answer_was_lost_is_written(
    app_and_key: tuple[Any, str], client: Any
) -> None:
    """Write 2's commit went through, its answer lost; 3 is kept behind it. The thread's tries
    while the server is down fail at the lookup of 2, before any commit: they must not make 3 one
    with 2, or 2 found would take 3 (never written) with it."""
    from server.worker.writes import Writes
    from tests.server.test_worker import dataset

    app, _ = app_and_key
    job_id = start_job(client, dataset(client))["id"]
    cut = _Cut(app.state.sessions)
    writes = Writes(cut, job_id)
    writes.write(_metrics(job_id, 1))
    cut.lose = 1
    writes.write(_metrics(job_id, 2))  # committed, its answer lost: kept, the server down
    writes.write(_metrics(job_id, 3))  # kept behind it
    refused = cut.refused
    # two tries while the server is down: the second at least began with 2 and 3 kept
    wait_for(lambda: cut.refused, until=lambda n: n > refused + 1, timeout=30, what="two tries while down")
    cut.down = False
    assert writes.drain(timeout=60) == 0
    series = client.get(f"/api/jobs/{job_id}/metrics", params={"keys": ["loss/train"]}).json()["data"]
    assert [p["step"] for p in series["loss/train"]] == [1, 2, 3]


def test_a_write_that_fails_for_another_reason_is_raised_not_kept(
    app_and_key: tuple[Any, str], client: Any
) -> None:
    from server.worker.writes import Writes
    from tests.server.test_worker import dataset

    app, _ = app_and_key
    job_id = start_job(client, dataset(client))["id"]
    writes = Writes(app.state.sessions, "no-such-job")
    with pytest.raises(Exception, match=r"(?i)foreign key"):
        writes.write(_metrics("no-such-job", 1))
    assert not writes.kept
    Writes(app.state.sessions, job_id).write(_metrics(job_id, 1))
