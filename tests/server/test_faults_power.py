"""Power cuts: every process of the service SIGKILLed at random moments, 20 times in all — while
migrations run, while uploads stream in, while a job trains and writes a checkpoint every step —
and then started again. After each cut the SQLite database passes ``PRAGMA integrity_check``,
every checkpoint a resume could pick loads whole, no row names a missing or different file, no
job stays ``running`` without a worker, and the job ends bitwise where an uninterrupted run ends.

A SIGKILL loses what a process had not handed to the kernel; it does not lose the kernel's page
cache, which a real power cut does: that part rests on the fsyncs (files, then folders) that the
writes do before a rename, which no test here can observe.

Real processes throughout: ``roundhouse keys list`` (it migrates a new database first),
``roundhouse serve``, ``roundhouse worker`` with its training child, on Redis and a SQLite file."""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from engine.training.checkpoint_layout import list_checkpoints
from server.app import create_app
from server.settings import Settings
from tests.server.conftest import WorkerProcess
from tests.server.test_durability import _settings, events
from tests.server.test_worker import ROWS, dataset
from tests.utils import Process, answers, child_env, free_port, roundhouse
from tests.utils.jobs import FINAL, start_job, states, wait_for, wait_for_job

MIGRATION_CUTS, UPLOAD_CUTS, TRAINING_CUTS = 7, 7, 6  # 20 power cuts
# steps of the job cut while it trains: enough that an idle machine, training the tiny model at
# several steps a second, does not finish it before the sixth cut
TRAINING_STEPS = 120


def integrity(database: Path) -> None:
    with sqlite3.connect(database) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []


def schema_is_head(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from server.db import make_engine
    from server.tables import Base

    engine = make_engine(url)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    engine.dispose()


@pytest.mark.slow
def test_power_cuts_during_migrations_leave_a_database_the_next_start_migrates(tmp_path: Path) -> None:
    rng = random.Random(27)
    for cut in range(MIGRATION_CUTS):
        home = tmp_path / f"home-{cut}"
        settings = Settings(home=home)
        env = child_env(**settings.child_environment())
        command = Process(roundhouse("keys", "list"), env=env, log=tmp_path / f"migrate-{cut}.log").start()
        # after the imports (about a second here), during the migrations (most of the rest)
        time.sleep(rng.uniform(0.8, 2.5))
        command.kill()
        database = home / "roundhouse.db"
        if database.exists():
            integrity(database)
        again = Process(roundhouse("keys", "list"), env=env, log=tmp_path / f"again-{cut}.log").start()
        assert again.proc is not None and again.proc.wait(timeout=120) == 0, again.tail()
        integrity(database)
        schema_is_head(settings.url)


def _upload_forever(base: str, key: str, stop: threading.Event, sent: list[str]) -> None:
    """Post datasets one after another until the server dies (or ``stop``)."""
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode() * 20
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        while not stop.is_set():
            try:
                r = http.post("/api/datasets", files={"file": (f"rows-{len(sent)}.jsonl", content)})
            except httpx.HTTPError:
                return
            if r.status_code == 201:
                sent.append(r.json()["id"])


@pytest.mark.slow
def test_power_cuts_during_uploads_leave_no_row_without_its_whole_file(tmp_path: Path) -> None:
    rng = random.Random(2027)
    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'roundhouse.db'}")
    app = create_app(settings)  # migrated, with its first key
    key = app.state.first_key
    assert key is not None
    env = child_env(**settings.child_environment())
    stored: list[str] = []
    for cut in range(UPLOAD_CUTS):
        port = free_port()
        server = Process(roundhouse("serve", "--port", str(port)), env=env, log=tmp_path / f"serve-{cut}.log")
        server.start().wait_for_http(f"http://127.0.0.1:{port}/api/health", timeout=60)
        stop, sent = threading.Event(), []
        uploader = threading.Thread(
            target=_upload_forever, args=(f"http://127.0.0.1:{port}", key, stop, sent)
        )
        uploader.start()
        time.sleep(rng.uniform(0.3, 2.0))
        server.kill()
        stop.set()
        uploader.join(timeout=60)
        stored += sent
        integrity(tmp_path / "roundhouse.db")
    with TestClient(create_app(settings)) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        rows = client.get("/api/datasets", params={"limit": 1000}).json()["data"]
    assert stored and set(stored) <= {d["id"] for d in rows}  # every answered upload is there
    for row in rows:  # and every row's file is whole: its recorded size and sum
        path = settings.datasets_dir / row["id"] / row["filename"]
        assert path.stat().st_size == row["size_bytes"], row
        assert hashlib.sha256(path.read_bytes()).hexdigest() == row["sha256"], row
    # what a cut upload leaves (a temporary file, or a whole one whose row was never committed) is
    # in a folder of its own that no row names: never beside a dataset's file, never taken for it
    ids = {row["id"] for row in rows}
    for path in settings.datasets_dir.rglob("*"):
        if path.is_file() and path.parent.name in ids:
            assert path.name == next(r["filename"] for r in rows if r["id"] == path.parent.name), path


def _whole(checkpoint: Path) -> None:
    """A checkpoint a resume could pick loads completely."""
    torch.load(checkpoint / "state" / "engine.pt", weights_only=True)
    json.loads((checkpoint / "state" / "trainer.json").read_text())
    load_file(checkpoint / "adapter_model.safetensors")


@pytest.mark.slow
def test_power_cuts_while_a_job_trains_and_checkpoints_end_bitwise_as_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    from engine.config import TrainConfig
    from engine.training.run import train

    if not answers("127.0.0.1", 6379):
        pytest.skip("no Redis server answers on 127.0.0.1:6379 (make test starts one)")
    rng = random.Random(1827)
    settings = _settings(tmp_path)
    app = create_app(settings)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {app.state.first_key}"
        job = start_job(
            client,
            dataset(client),
            hyper={"max_steps": TRAINING_STEPS},
            checkpoint={"every_steps": 1, "keep_last": 2},  # a checkpoint written at every step
        )
        job_id, total = job["id"], TRAINING_STEPS
        folder = Path(job["config"]["output_dir"]) / "checkpoints"
        workers: list[WorkerProcess] = []

        def logs() -> str:
            return "\n".join(w.tail() for w in workers[-2:])

        cuts = 0
        try:
            for cut in range(TRAINING_CUTS):
                worker = WorkerProcess(settings, tmp_path / f"worker-{cut}.log").start()
                workers.append(worker)
                before = client.get(f"/api/jobs/{job_id}").json()["step"]
                # training again (after the lease of the killed worker ran out and a worker took it)
                wait_for(
                    lambda: client.get(f"/api/jobs/{job_id}").json(),
                    until=lambda j, before=before: j["step"] > before or j["status"] in FINAL,
                    timeout=120,
                    what=f"job {job_id} training again after cut {cut}",
                    details=logs,
                )
                time.sleep(rng.uniform(0.0, 0.5))
                if client.get(f"/api/jobs/{job_id}").json()["status"] in FINAL:
                    break
                worker.kill_group()  # the whole worker: its main process, its pool and the training child
                assert worker.proc is not None
                worker.proc.wait()
                cuts += 1
                integrity(tmp_path / "roundhouse.db")
                for _, checkpoint in list_checkpoints(folder):
                    _whole(checkpoint)
            assert cuts == TRAINING_CUTS, f"the job finished after {cuts} cuts"
            last = WorkerProcess(settings, tmp_path / "worker-last.log").start()
            workers.append(last)
            done = wait_for_job(client, job_id, FINAL, timeout=240, logs=logs)
        finally:
            for w in workers:
                w.stop(grace=10)
                w.kill_group()
        assert done["status"] == "succeeded" and done["step"] == total, done
        integrity(tmp_path / "roundhouse.db")
        went = states(client, job_id)
        assert went.count("interrupted") == cuts, went  # each cut noticed, none stuck running
        assert done["attempts"] == cuts + 1
        saved = client.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
        assert [c["step"] for c in saved][-1] == total
        assert sorted(p.name for p in folder.iterdir()) == [f"step_{total - 1:06d}", f"step_{total:06d}"]
        recovered = [e for e in events(client, job_id) if e["data"].get("recovered")]
        resumed = [e["data"]["step"] for e in events(client, job_id) if e["kind"] == "resume"]
        assert len(resumed) >= cuts - 1, resumed  # a cut before the first checkpoint restarts from 0
    # the same config trained without a cut
    reference = tmp_path / "reference"
    train(
        TrainConfig.model_validate(job["config"] | {"output_dir": str(reference)}),
        models_dir=settings.models_dir,
    )
    name = f"step_{total:06d}/adapter_model.safetensors"
    ours, theirs = load_file(folder / name), load_file(reference / "checkpoints" / name)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    print(f"{cuts} cuts, {len(recovered)} checkpoint rows recovered from disk, resumed at {resumed}")
