"""Jobs on several hosts, the service's side (no training): ``placement.hosts`` and ``min_hosts``
checked and stored, the hosts reserved all at once or not at all (a busy, stale or reserved host
leaves nothing behind), "auto" no wider than the batch gives work to, a batch too small for its
hosts refused at submission, rank 0 the host of the last run's checkpoints, a reserved host claiming
no other job, each box's message on its host queue, and a silent box pausing the job, naming it."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select, update

from engine import TrainConfig
from engine.distributed import RENDEZVOUS_PORT
from server import queue
from server.db import make_engine, session_factory
from server.services import boxes, gpus, jobs, placement
from server.services.gpus import Endpoint
from server.settings import Settings
from server.tables import Job, JobBox, Worker, now
from server.worker.supervisor import supervise
from tests.server.test_worker import dataset
from tests.utils.jobs import job_body, start_job

LEASE_S = 30.0


def register(session: Any, host: str, *, port: int = 29400, age_s: float = 0.0) -> str:
    """A worker of ``host`` (one GPU) with its rendezvous registration; returns its id."""
    worker = f"w@{host}"
    device = {"index": 0, "name": "GPU", "utilization": 0.0, "memory_used": 0, "memory_total": 24e9}
    endpoint = Endpoint(f"10.0.0.{ord(host[-1]) - 96}", port, "eth0", 10.0)
    gpus.record(
        session, worker_id=worker, hostname=host, devices=[device], cpu={}, message="", endpoint=endpoint
    )
    if age_s:
        session.execute(
            update(Worker).where(Worker.id == worker).values(heartbeat_at=now() - timedelta(seconds=age_s))
        )
        session.commit()
    return worker


def rows(session: Any) -> list[tuple[str, int, str]]:
    return [
        (r.job_id, r.rank, r.hostname)
        for r in session.scalars(select(JobBox).order_by(JobBox.job_id, JobBox.rank))
    ]


def test_hosts_and_min_hosts_are_checked_and_stored(client: TestClient) -> None:
    base = job_body(dataset(client))
    wrong = {
        "hosts": ({"hosts": 2, "host": "a"}, "placement.hosts=2 with placement.host='a'"),
        "min_hosts": ({"hosts": 2, "min_hosts": 3}, "placement.min_hosts=3 is more than placement.hosts=2"),
        "alone": ({"min_hosts": 1}, "placement.min_hosts=1 needs placement.hosts"),
        "zero": ({"hosts": 0}, "hosts"),
        "many": ({"hosts": 65}, "hosts"),
        "word": ({"hosts": "all"}, "hosts"),
    }
    for name, (bad, says) in wrong.items():
        r = client.post("/api/jobs", json=base | {"placement": bad})
        assert r.status_code == 422, (name, r.text)
        assert says in r.text, (name, r.text)
    job = start_job(client, base["dataset_id"], placement={"hosts": 2, "min_hosts": 1})
    assert job["placement"] == {"host": None, "gpus": None, "hosts": 2, "min_hosts": 1}
    auto = start_job(client, base["dataset_id"], placement={"hosts": "auto", "gpus": 2})
    assert auto["placement"] == {"host": None, "gpus": 2, "hosts": "auto", "min_hosts": None}
    one = start_job(client, base["dataset_id"], placement={"hosts": 1})
    assert one["placement"] is None  # one host: a plain job
    events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
    assert any(
        e["message"] == "waiting for 2 hosts (at least 1): no online worker has it now" for e in events
    )
    assert placement.queue_for("rh", job["placement"]) == "rh"  # the worker that takes it reserves
    assert placement.describe(auto["placement"]) == "as many hosts as fit with 2 GPUs each"


def test_hosts_are_reserved_all_at_once_or_not_at_all(client: TestClient, settings: Settings) -> None:
    data = dataset(client)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        workers = {h: register(session, h, port=29400 + i) for i, h in enumerate("abc")}
        register(session, "d", age_s=3600)  # stale: never taken
    three = start_job(client, data, placement={"hosts": 3}, hyper={"batch_size": 6})["id"]
    single = start_job(client, data)["id"]
    stale_after = settings.telemetry_seconds * 5

    def reserve(job_id: str) -> boxes.Reservation | None:
        with sessions() as session:
            job = jobs.get_job(session, job_id=job_id)
            assert job is not None
            return boxes.reserve(session, job=job, lease_seconds=LEASE_S, stale_after=stale_after)

    # host b runs a job of its own: three hosts are not free, and nothing is reserved
    with sessions() as session:
        assert jobs.claim(session, job_id=single, worker_id=workers["b"], lease_seconds=LEASE_S, host="b")
    assert reserve(three) is None
    with sessions() as session:
        assert rows(session) == []
        assert jobs.status_of(session, job_id=three) == "queued"
    events = client.get(f"/api/jobs/{three}/events").json()["data"]
    assert events[-1]["message"] == "waiting for 3 hosts: 2 free now (a, c)"
    assert reserve(three) is None  # said once
    assert client.get(f"/api/jobs/{three}/events").json()["data"][-1]["id"] == events[-1]["id"]

    # b is free again: a, b and c at once; rank 0 listens at a's address and port
    with sessions() as session:
        assert jobs.finish(session, job_id=single, worker_id=workers["b"], to="succeeded", message="done")
    run = reserve(three)
    assert run is not None
    assert [(b.rank, b.hostname, b.worker_id) for b in run.boxes] == [
        (rank, host, workers[host]) for rank, host in enumerate("abc")
    ]
    assert run.rendezvous == "10.0.0.1:29400"
    job = client.get(f"/api/jobs/{three}").json()
    assert (job["status"], job["attempts"]) == ("running", 1)
    state = [e for e in client.get(f"/api/jobs/{three}/events").json()["data"] if e["kind"] == "state"][-1]
    assert state["message"] == "queued -> running on 3 hosts: a (rank 0), b (rank 1), c (rank 2)"
    assert state["data"]["rendezvous"] == "10.0.0.1:29400"

    # a reserved host claims no other job, and no other reservation takes it
    other = start_job(client, data)["id"]
    two = start_job(client, data, placement={"hosts": 2, "min_hosts": 1})["id"]
    with sessions() as session:
        assert not jobs.claim(session, job_id=other, worker_id=workers["a"], lease_seconds=LEASE_S, host="a")
        assert jobs.status_of(session, job_id=other) == "queued"
    assert reserve(two) is None
    with sessions() as session:
        assert sorted(h for j, _, h in rows(session) if j == three) == ["a", "b", "c"]
        assert [r for r in rows(session) if r[0] == two] == []
        # a unique host: a second row for host a cannot be written, whatever the code above checks
        session.add(
            JobBox(
                job_id=two,
                generation=1,
                rank=0,
                hostname="a",
                worker_id="x",
                address="x",
                port=1,
                lease_until=now(),
            )
        )
        try:
            session.commit()
            raise AssertionError("a host held two reservations")
        except Exception as exc:  # IntegrityError, by backend
            assert "unique" in str(exc).lower() or "duplicate" in str(exc).lower(), exc
            session.rollback()

    # the run ends (rows released): min_hosts 1 lets the two-host job start on the one free host
    # left after a single job takes b; the host that wrote the last run's checkpoints is rank 0
    with sessions() as session:
        jobs.add_event(session, job_id=two, kind=boxes.BOXES_EVENT, data={"hosts": ["c", "a"]})
        session.execute(update(Job).where(Job.id == three).values(status="succeeded"))
        session.commit()
        boxes.release(session, job_id=three)
        assert jobs.claim(session, job_id=other, worker_id=workers["b"], lease_seconds=LEASE_S, host="b")
    run = reserve(two)
    assert run is not None
    assert [(b.rank, b.hostname) for b in run.boxes] == [(0, "c"), (1, "a")]
    assert run.rendezvous == "10.0.0.3:29402"


def test_the_worker_that_takes_the_job_sends_each_host_its_box(
    client: TestClient, settings: Settings
) -> None:
    data = dataset(client)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        for host in "ab":
            register(session, host)
    job_id = start_job(client, data, placement={"hosts": 2})["id"]
    here = settings.model_copy(update={"worker_host": "a", "worker_gpus": 1})
    assert supervise(here, sessions, job_id=job_id, worker_id="w@a") == (
        "reserved a, b; rendezvous 10.0.0.1:29400"
    )
    for host in "ab":  # each box's message waits on its host's queue
        assert queue.waiting(settings, {placement.host_queue(settings.queue, host)}) == {job_id}, host
    # a second message of the job (a redelivery) reserves nothing more
    again = supervise(here, sessions, job_id=job_id, worker_id="w@a")
    assert again == "not claimable (taken, finished or cancelled)"


def test_a_silent_box_pauses_the_job_naming_its_host(client: TestClient, settings: Settings) -> None:
    data = dataset(client)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        for host in "abc":
            register(session, host)
    job_id = start_job(client, data, placement={"hosts": 3}, hyper={"batch_size": 6})["id"]
    with sessions() as session:
        job = jobs.get_job(session, job_id=job_id)
        assert job is not None
        run = boxes.reserve(session, job=job, lease_seconds=LEASE_S, stale_after=60.0)
        assert run is not None
        assert boxes.start(session, job_id=job_id, generation=run.generation, rank=0, lease_seconds=LEASE_S)
        assert not boxes.start(
            session, job_id=job_id, generation=run.generation, rank=0, lease_seconds=LEASE_S
        )
        assert boxes.sweep(session) == []  # every lease is current
        # box 2 (host c) is done (it lost another box, or the run ended): it frees its host, and
        # box 1 (host b) stops renewing: its lease runs out, and only it is the box lost
        boxes.leave(session, job_id=job_id, generation=run.generation, rank=2)
        assert [h for _, _, h in rows(session)] == ["a", "b"]
        session.execute(update(JobBox).values(lease_until=now() - timedelta(seconds=1)))
        session.execute(
            update(JobBox).where(JobBox.rank == 0).values(lease_until=now() + timedelta(seconds=60))
        )
        session.commit()
        assert boxes.sweep(session) == [job_id]
        assert rows(session) == []  # its hosts are free
        assert not boxes.renew(session, job_id=job_id, generation=run.generation, rank=0, lease_seconds=1.0)
    job = client.get(f"/api/jobs/{job_id}").json()
    assert job["status"] == "interrupted"
    state = [e for e in client.get(f"/api/jobs/{job_id}/events").json()["data"] if e["kind"] == "state"][-1]
    assert state["data"]["box_lost"] == "b" and state["data"]["rank"] == 1
    assert state["message"].startswith(
        "box b (rank 1) lost: its worker w@b stopped answering; paused at the start"
    )
    with sessions() as session:  # it is sent again, to resume on the hosts free then
        assert [ident for ident, _, _ in jobs.due_sends(session, stale_before=now())] == [job_id]


def test_a_worker_registers_where_the_other_boxes_reach_it() -> None:
    from server.worker import network

    given = network.endpoint(Settings(advertise_address="10.1.2.3", rendezvous_port=29500))
    assert given == Endpoint("10.1.2.3", 29500, None, None)  # no NIC here holds that address
    found = network.endpoint(Settings())
    nics = network.nic_addresses()
    assert found.port == RENDEZVOUS_PORT
    if not nics:
        assert (found.address, found.interface) == ("127.0.0.1", None)
        return
    assert found.interface is not None and found.address in nics[found.interface]
    speed = network.SYS_NET / found.interface / "speed"
    try:
        megabits = int(speed.read_text())
    except (OSError, ValueError):
        megabits = -1
    assert found.link_gbps == (megabits / 1000 if megabits > 0 else None)


def test_migration_0014_adds_the_boxes_table_and_registration_as_declared(database_url: str) -> None:
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from server.db import MIGRATIONS
    from server.tables import Base

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    for step, target in ((command.upgrade, "0014"), (command.downgrade, "0013"), (command.upgrade, "head")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            tables = set(inspect(conn).get_table_names())
            columns = {c["name"] for c in inspect(conn).get_columns("workers")}
            assert ("job_boxes" in tables) == (target != "0013"), target
            assert ("address" in columns) == (target != "0013"), target
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [
        d for d in diff if "job_boxes" in repr(d) or "'workers'" in repr(d) or "workers." in repr(d)
    ] == []


def test_a_claim_waits_for_a_reservation_of_its_host_in_progress(
    client: TestClient, settings: Settings
) -> None:
    data = dataset(client)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        register(session, "b")
    several = start_job(client, data, placement={"hosts": 2})["id"]
    single = start_job(client, data)["id"]
    claimed: list[bool] = []

    def claim() -> None:
        with sessions() as session:
            claimed.append(
                jobs.claim(session, job_id=single, worker_id="w@b", lease_seconds=LEASE_S, host="b")
            )

    with sessions() as reserving:  # a reservation of host b, not yet committed
        boxes.lock_hosts(reserving, ["b"])
        reserving.execute(update(Job).where(Job.id == several).values(status="running"))
        reserving.add(
            JobBox(
                job_id=several,
                generation=1,
                rank=0,
                hostname="b",
                worker_id="w@b",
                address="10.0.0.2",
                port=29400,
                lease_until=now() + timedelta(seconds=LEASE_S),
            )
        )
        reserving.flush()
        thread = threading.Thread(target=claim)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive(), "the claim did not wait for the reservation"
        reserving.commit()
    thread.join(30)
    assert claimed == [False]  # it saw the reservation: host b runs nothing else
    with sessions() as session:
        assert jobs.status_of(session, job_id=single) == "queued"


def test_auto_takes_every_free_host_that_fits_and_at_least_min_hosts(
    client: TestClient, settings: Settings
) -> None:
    data = dataset(client)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        for host in "abc":
            register(session, host)
        register(session, "d", age_s=3600)  # stale
    wide = {"batch_size": 8}  # 4 boxes x 2 micro-batches: the batch is not what stops them
    wants_four = start_job(client, data, placement={"hosts": "auto", "min_hosts": 4}, hyper=wide)["id"]
    auto = start_job(client, data, placement={"hosts": "auto"}, hyper=wide)["id"]
    with sessions() as session:
        job = jobs.get_job(session, job_id=wants_four)
        assert job is not None
        assert boxes.reserve(session, job=job, lease_seconds=LEASE_S, stale_after=60.0) is None
        job = jobs.get_job(session, job_id=auto)
        assert job is not None
        run = boxes.reserve(session, job=job, lease_seconds=LEASE_S, stale_after=60.0)
    assert run is not None and [b.hostname for b in run.boxes] == ["a", "b", "c"]
    events = client.get(f"/api/jobs/{wants_four}/events").json()["data"]
    assert events[-1]["message"] == "waiting for as many hosts as fit (at least 4): 3 free now (a, b, c)"


def test_auto_stops_at_the_hosts_its_batch_gives_work_to(client: TestClient, settings: Settings) -> None:
    data = dataset(client)
    sessions = session_factory(make_engine(settings.url))
    with sessions() as session:
        for host in "abc":
            register(session, host)
    # a batch of 4 in 2 micro-batches a box feeds 2 boxes, though 3 are free
    auto = start_job(client, data, placement={"hosts": "auto"}, hyper={"batch_size": 4})["id"]
    with sessions() as session:
        job = jobs.get_job(session, job_id=auto)
        assert job is not None
        run = boxes.reserve(session, job=job, lease_seconds=LEASE_S, stale_after=60.0)
        assert run is not None and [b.hostname for b in run.boxes] == ["a", "b"]
        assert rows(session) == [(auto, 0, "a"), (auto, 1, "b")]
        # a GRPO job's prompts feed a box each only while their completions fill its micro-batches
        grader = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}"}
        grader |= {"reference": "{{item.reference_answer}}", "operation": "eq"}
        method = {"objective": "grpo", "grader": grader, "group_size": 2, "max_completion_tokens": 16}
        grpo = dict(job.config) | {"method": method}
        grpo["hyper"] = grpo["hyper"] | {"batch_size": 3}
        grpo["engine"] = grpo["engine"] | {"num_microbatches": 2}
        assert boxes.batch_hosts(TrainConfig.model_validate(grpo)) == 3  # a prompt's 2 fill each box
        grpo["engine"] = grpo["engine"] | {"num_microbatches": 4}
        assert boxes.batch_hosts(TrainConfig.model_validate(grpo)) == 1  # 3 prompts x 2 fill one box's 4


def test_a_batch_too_small_for_its_hosts_is_refused_at_submission(client: TestClient) -> None:
    data = dataset(client)
    for asked, says in (
        ({"hosts": 3}, "placement.hosts=3"),
        ({"hosts": "auto", "min_hosts": 3}, "placement.hosts='auto' with placement.min_hosts=3"),
    ):
        r = client.post("/api/jobs", json=job_body(data, placement=asked, hyper={"batch_size": 4}))
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["param"] == "hyper.batch_size", error
        assert "at least 6" in error["message"] and says in error["message"], error
    assert client.get("/api/jobs").json()["data"] == []  # nothing stored
    start_job(client, data, placement={"hosts": 3}, hyper={"batch_size": 6})
