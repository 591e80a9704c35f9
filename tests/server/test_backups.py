"""``roundhouse backup DIR`` then ``roundhouse restore DIR`` onto an empty home: every job (finished,
paused, failed) with its events and checkpoints, every dataset with its file, and the API keys
come back, and the restored service serves them (a checkpoint downloads with the same bytes).
Real commands on a SQLite file and the home folder as the store; on PostgreSQL (a fresh database
of the shared server each side) with the home folder; on PostgreSQL with an S3 store (a moto
server), whose objects stay in the bucket and are listed in the backup."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from server.app import create_app
from server.kinds import JobStatus
from server.services import backups, checkpoints, jobs
from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.server.conftest import postgres_database
from tests.server.test_worker import dataset
from tests.utils import child_env, roundhouse
from tests.utils.jobs import start_job
from tests.utils.s3 import S3Server, s3_server

__all__ = ["s3_server"]  # a fixture used here


def _settings(home: Path, database_url: str | None = None, **store: Any) -> Settings:
    url = database_url or f"sqlite:///{home / 'roundhouse.db'}"
    return Settings(home=home, database_url=url, hub_offline=True, **store)


@pytest.fixture(params=["sqlite", "postgresql", "postgresql+s3"])
def homes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Settings, Settings]]:
    """The settings of the home backed up and of the empty home it is restored onto: each with a
    database of its own (SQLite files, or two fresh PostgreSQL databases), and with S3 both on the
    one bucket (the objects stay there)."""
    home, fresh = tmp_path / "home", tmp_path / "fresh"
    with contextlib.ExitStack() as stack:
        urls: list[str | None] = [None, None]
        store: dict[str, Any] = {}
        if request.param.startswith("postgresql"):
            urls = [stack.enter_context(postgres_database()) for _ in range(2)]
        if request.param.endswith("s3"):
            server: S3Server = request.getfixturevalue("s3_server")
            store = server.settings()
        yield _settings(home, urls[0], **store), _settings(fresh, urls[1], **store)


def _run(settings: Settings, *args: str) -> str:
    done = subprocess.run(
        roundhouse(*args), env=child_env(**settings.child_environment()), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _home_with_jobs(settings: Settings, client: TestClient) -> dict[str, str]:
    """A succeeded job with a checkpoint, a paused one with its checkpoint, a failed one."""
    from engine.config import TrainConfig
    from engine.training.run import train

    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    storage = client.app.state.storage  # type: ignore[attr-defined]
    ds = dataset(client)
    made = {status: start_job(client, ds) for status in ("succeeded", "paused", "failed")}
    config = made["succeeded"]["config"]
    if storage.local_path("runs") is None:  # S3: trained here from a copy, the checkpoints stored
        train_file = settings.home / "train" / Path(config["data"]["train"]).name
        storage.get_file(config["data"]["train"], train_file)
        local = {
            "output_dir": str(settings.home / "trained"),
            "data": config["data"] | {"train": str(train_file)},
        }
        train(TrainConfig.model_validate(config | local), models_dir=settings.models_dir)
        for status in ("succeeded", "paused"):
            storage.put_tree(
                f"runs/{made[status]['id']}/checkpoints", settings.home / "trained" / "checkpoints"
            )
    else:
        train(TrainConfig.model_validate(config), models_dir=settings.models_dir)
        paused = Path(made["paused"]["config"]["output_dir"]) / "checkpoints"
        shutil.copytree(Path(config["output_dir"]) / "checkpoints", paused)
    outcomes = {
        "succeeded": (JobStatus.SUCCEEDED, None),
        "paused": (JobStatus.PAUSED, "disk full: the next checkpoint did not fit"),
        "failed": (JobStatus.FAILED, "ValueError: broken"),
    }
    with sessions() as session:
        for status, job in made.items():
            assert jobs.claim(session, job_id=job["id"], worker_id="w", lease_seconds=60)
            if status != "failed":
                key = f"runs/{job['id']}/checkpoints/step_000002"
                checkpoints.record(session, job_id=job["id"], step=2, path=key, kind="adapter", metrics={})
            to, error = outcomes[status]
            assert jobs.finish(session, job_id=job["id"], worker_id="w", to=to, message=status, error=error)
    return {status: job["id"] for status, job in made.items()}


def _sums(archive: bytes) -> bytes:
    """The download's manifest of SHA-256 sums (its archive is rebuilt, with a new time)."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith("/MANIFEST.sha256")]
        found = tar.extractfile(member)
        assert found is not None
        return found.read()


def _snapshot(client: TestClient) -> dict[str, object]:
    listed = client.get("/api/jobs", params={"limit": 100}).json()["data"]
    out: dict[str, object] = {"datasets": client.get("/api/datasets").json()["data"]}
    for job in listed:
        ident = job["id"]
        out[ident] = {
            "job": {k: job[k] for k in ("status", "step", "error", "name", "config", "attempts")},
            "events": [
                (e["id"], e["kind"], e["message"])
                for e in client.get(f"/api/jobs/{ident}/events", params={"limit": 1000}).json()["data"]
            ],
            "checkpoints": [c["step"] for c in client.get(f"/api/jobs/{ident}/checkpoints").json()["data"]],
        }
    return out


def test_a_backup_restored_onto_an_empty_home_gives_back_every_job_dataset_checkpoint_and_key(
    tmp_path: Path, homes: tuple[Settings, Settings]
) -> None:
    settings, restored = homes
    tiny_model_folder(settings.models_dir / "tiny")
    app = create_app(settings)
    key = app.state.first_key
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        made = _home_with_jobs(settings, client)
        before = _snapshot(client)
        step = f"/api/jobs/{made['succeeded']}/checkpoints/2/download"
        archive = client.get(step)
        assert archive.status_code == 200, archive.text
        # online: the service is running while the backup is taken
        _run(settings, "backup", str(tmp_path / "backup"))
        storage = client.app.state.storage  # type: ignore[attr-defined]
        stored = storage.list("")
    backup = tmp_path / "backup"
    assert "exports" not in {p.name for p in backup.rglob("*")}  # rebuilt on demand
    manifest = json.loads((backup / "backup.json").read_text())
    assert manifest["database"] == make_url(settings.url).get_backend_name()
    if storage.local_path("runs") is None:  # S3: the objects stay, listed with their sizes
        assert not (backup / "home").exists()
        listed = json.loads((backup / "objects.json").read_text())
        assert listed["store"] == storage.url
        assert [(o["key"], o["bytes"]) for o in listed["objects"]] == stored

    tiny_model_folder(restored.models_dir / "tiny")  # base models are not part of a backup
    said = _run(restored, "restore", str(backup))
    remote = storage.local_path("runs") is None
    assert (f"all {len(stored)} object(s) the backup lists are in the store" in said) == remote, said
    again = create_app(restored)
    assert again.state.first_key is None  # the keys came back: no new first key
    with TestClient(again) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        after = _snapshot(client)
        assert after == before
        statuses = {ident: client.get(f"/api/jobs/{ident}").json()["status"] for ident in made.values()}
        assert statuses == {made[s]: s for s in ("succeeded", "paused", "failed")}
        assert _sums(client.get(step).content) == _sums(archive.content)  # rebuilt: same files
        store = client.app.state.storage  # type: ignore[attr-defined]
        for ds in after["datasets"]:  # type: ignore[attr-defined]
            assert store.exists(f"datasets/{ds['id']}/{ds['filename']}")
        assert client.post(f"/api/jobs/{made['paused']}/resume").status_code == 200
        if remote:  # an object lost from the bucket is named; a download (rebuilt) is not missed
            lost = next(k for k, _ in stored if k.startswith("datasets/"))
            store.delete(lost)
            for export, _ in store.list(f"runs/{made['succeeded']}/exports"):
                store.delete(export)
            assert backups.missing_objects(store, backup) == [lost]
    # a home that holds jobs is not overwritten
    refused = subprocess.run(
        roundhouse("restore", str(backup)),
        env=child_env(**restored.child_environment()),
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "restore into an empty home" in refused.stderr, refused.stderr


def test_a_postgresql_backup_of_an_older_release_is_restored_and_brought_up_to_date(tmp_path: Path) -> None:
    """A dump taken at migration 0011 (before sweeps) restored onto an empty home whose database
    the current release made: the newer tables do not stand in the way, and it is migrated."""
    from alembic import command
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from sqlalchemy import text

    from server.db import MIGRATIONS, make_engine

    with postgres_database() as old_url, postgres_database() as new_url:
        engine = make_engine(old_url)
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0011")
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO api_keys (name, prefix, hash, created_at) VALUES ('old', 'rh_x', 'h', now())"
                )
            )
        engine.dispose()
        backup = tmp_path / "backup"
        backup.mkdir()
        old = _settings(tmp_path / "old", old_url)
        dump = [
            backups._tool("pg_dump"),
            "--format=custom",
            "--no-owner",
            "-f",
            str(backup / backups.PG_DUMP),
        ]
        subprocess.run([*dump, backups._postgres_url(old)], check=True)
        manifest = {
            "database": "postgresql",
            "revision": "0011",
            "store": "file",
            "files": 0,
            "created": "then",
        }
        (backup / backups.MANIFEST).write_text(json.dumps(manifest))

        restored = _settings(tmp_path / "fresh", new_url)
        create_app(restored)  # the service started once on the new home: its tables are the newest
        _run(restored, "restore", str(backup))
        engine = make_engine(new_url)
        with engine.connect() as conn:
            head = ScriptDirectory.from_config(cfg).get_current_head()
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
            assert conn.execute(text("SELECT name FROM api_keys")).scalars().all() == ["old"]
            assert conn.execute(text("SELECT count(*) FROM sweeps")).scalar() == 0
        engine.dispose()
