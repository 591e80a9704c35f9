"""``roundhouse backup DIR`` then ``roundhouse restore DIR`` onto an empty home: every job (finished,
paused, failed) with its events and checkpoints, every dataset with its file, and the API keys
come back, and the restored service serves them (a checkpoint downloads with the same bytes).
Real commands on a SQLite file and the home folder as the store."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

from fastapi.testclient import TestClient

from server.app import create_app
from server.kinds import JobStatus
from server.services import checkpoints, jobs
from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.server.test_worker import dataset
from tests.utils import child_env, roundhouse
from tests.utils.jobs import start_job


def _settings(home: Path) -> Settings:
    return Settings(home=home, database_url=f"sqlite:///{home / 'roundhouse.db'}", hub_offline=True)


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
    ds = dataset(client)
    made = {status: start_job(client, ds) for status in ("succeeded", "paused", "failed")}
    done = made["succeeded"]
    train(TrainConfig.model_validate(done["config"]), models_dir=settings.models_dir)
    paused = Path(made["paused"]["config"]["output_dir"]) / "checkpoints"
    shutil.copytree(Path(done["config"]["output_dir"]) / "checkpoints", paused)
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
    tmp_path: Path,
) -> None:
    home, fresh = tmp_path / "home", tmp_path / "fresh"
    tiny_model_folder(home / "models" / "tiny")
    settings = _settings(home)
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
    assert "exports" not in {p.name for p in (tmp_path / "backup").rglob("*")}  # rebuilt on demand

    restored = _settings(fresh)
    tiny_model_folder(fresh / "models" / "tiny")  # base models are not part of a backup
    _run(restored, "restore", str(tmp_path / "backup"))
    again = create_app(restored)
    assert again.state.first_key is None  # the keys came back: no new first key
    with TestClient(again) as client:
        client.headers["Authorization"] = f"Bearer {key}"
        after = _snapshot(client)
        assert after == before
        statuses = {ident: client.get(f"/api/jobs/{ident}").json()["status"] for ident in made.values()}
        assert statuses == {made[s]: s for s in ("succeeded", "paused", "failed")}
        assert _sums(client.get(step).content) == _sums(archive.content)  # rebuilt: same files
        for ds in after["datasets"]:  # type: ignore[union-attr]
            assert (restored.datasets_dir / ds["id"] / ds["filename"]).is_file()
        assert client.post(f"/api/jobs/{made['paused']}/resume").status_code == 200
    # a home that holds jobs is not overwritten
    refused = subprocess.run(
        roundhouse("restore", str(tmp_path / "backup")),
        env=child_env(**restored.child_environment()),
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and "restore into an empty home" in refused.stderr, refused.stderr
