"""A disk that fills while a job trains: a real tmpfs mounted as the runs folder, filled by a
ballast file. The checkpoint that does not fit is refused before it is written (the reserve), no
partial folder stays, the job is paused (not failed) with an event naming the path, the bytes
needed and free, ``/api/disk`` lists it, and a resume once space is freed ends bitwise where an
uninterrupted run ends. Uploads that fill the disk answer 507 and leave nothing behind.

A real ``roundhouse worker`` on Redis, a SQLite file outside the small disk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from server.app import create_app
from server.services import checkpoints
from server.settings import Settings
from tests.server.conftest import WorkerProcess
from tests.server.test_durability import _settings, events
from tests.server.test_worker import dataset
from tests.utils import answers
from tests.utils.filesystems import fill, small_disk
from tests.utils.jobs import FINAL, start_job, wait_for_job

MiB = 1 << 20
RESERVE = MiB


def _reference(config: dict, folder: Path, models_dir: Path) -> Path:
    from engine.config import TrainConfig
    from engine.training.run import train

    train(TrainConfig.model_validate(config | {"output_dir": str(folder)}), models_dir=models_dir)
    return folder / "checkpoints"


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    if not answers("127.0.0.1", 6379):
        pytest.skip("no Redis server answers on 127.0.0.1:6379 (make test starts one)")
    return _settings(tmp_path, checkpoint_reserve_bytes=RESERVE)


@pytest.fixture
def runs_disk(settings: Settings) -> Iterator[Path]:
    with small_disk(settings.runs_dir, 64 * MiB) as disk:
        yield disk


@pytest.mark.slow
def test_a_full_disk_pauses_the_job_and_a_resume_after_freeing_space_ends_bitwise_the_same(
    settings: Settings, runs_disk: Path, tmp_path: Path
) -> None:
    app = create_app(settings)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    try:
        with TestClient(app) as client:
            client.headers["Authorization"] = f"Bearer {app.state.first_key}"
            job = start_job(client, dataset(client), hyper={"max_steps": 12}, checkpoint={"every_steps": 4})
            # the same config trained without a stop (before the worker starts: the job waits)
            reference = _reference(job["config"], tmp_path / "reference", settings.models_dir)
            one = reference / "step_000004"
            size = _bytes(one)
            tensors = (one / "state" / "engine.pt").stat().st_size + sum(
                p.stat().st_size for p in one.glob("*.safetensors")
            )
            needed = tensors + MiB + RESERVE  # what the worker's check asks for (engine SLACK_BYTES)
            # room for the step-4 checkpoint and its check, not for the step-8 one beside it
            ballast = fill(runs_disk, leave_bytes=needed + size // 2)
            worker.start()
            job = wait_for_job(client, job["id"], {"paused"}, logs=[worker])
            assert job["step"] == 8 and "disk full" in (job["error"] or ""), job
            folder = Path(job["config"]["output_dir"]) / "checkpoints"
            assert str(folder / "step_000008") in job["error"]
            (full,) = [e for e in events(client, job["id"]) if e["data"].get("disk_full")]
            data = full["data"]
            assert data["path"] == str(folder / "step_000008")
            assert data["needed_bytes"] >= needed - 64 * 1024 and data["free_bytes"] < data["needed_bytes"]
            # nothing partial, and the step-4 checkpoint is the one a resume picks
            assert sorted(p.name for p in folder.iterdir()) == ["step_000004"]
            saved = client.get(f"/api/jobs/{job['id']}/checkpoints").json()["data"]
            assert [c["step"] for c in saved] == [4]
            disk = client.get("/api/disk").json()
            assert disk["reserve_bytes"] == RESERVE
            assert [p["job_id"] for p in disk["paused_for_space"]] == [job["id"]]
            assert "step_000008" in disk["paused_for_space"][0]["message"]

            ballast.unlink()
            r = client.post(f"/api/jobs/{job['id']}/resume")
            assert r.status_code == 200, r.text
            job = wait_for_job(client, job["id"], FINAL, logs=[worker])
            assert job["status"] == "succeeded" and job["error"] is None, job
            assert client.get("/api/disk").json()["paused_for_space"] == []
            resumed = [e for e in events(client, job["id"]) if e["kind"] == "resume"]
            assert [e["data"]["step"] for e in resumed] == [4]
            for step in (4, 8, 12):
                name = f"step_{step:06d}/adapter_model.safetensors"
                ours, theirs = load_file(folder / name), load_file(reference / name)
                assert ours.keys() == theirs.keys()
                assert all(torch.equal(ours[k], theirs[k]) for k in ours), step
    finally:
        worker.end()


def test_an_upload_that_fills_the_disk_answers_507_and_leaves_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    with small_disk(settings.datasets_dir, 256 * 1024):
        app = create_app(settings)
        with TestClient(app) as client:
            client.headers["Authorization"] = f"Bearer {app.state.first_key}"
            row = '{"text": "' + "x" * 1000 + '"}\n'
            r = client.post("/api/datasets", files={"file": ("big.jsonl", (row * 400).encode())})
            assert r.status_code == 507, r.text
            error = r.json()["error"]
            assert error["code"] == "disk_full" and str(settings.datasets_dir) in error["message"], error
            assert list(settings.datasets_dir.rglob("*.*")) == []  # no partial file
            assert client.get("/api/datasets").json()["data"] == []
            small = client.post("/api/datasets", files={"file": ("small.jsonl", (row * 10).encode())})
            assert small.status_code == 201, small.text


@pytest.fixture
def plain_settings(tmp_path: Path) -> Settings:
    """Settings with no Redis (nothing here needs a worker): the broker is a folder."""
    return _settings(tmp_path, redis_url=None)


def _snapshot(folder: Path) -> dict[str, bytes]:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


@pytest.mark.parametrize("kind", ["adapter", "merged", "gguf"])
def test_a_download_build_that_fills_the_disk_answers_507_and_leaves_nothing(
    plain_settings: Settings, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The archive (and a merged or GGUF build's scratch folder) that does not fit is removed,
    the answer names the path, the bytes needed and free, the checkpoint stays as it was, and the
    same request once space is freed builds it whole."""
    from tests.server.test_checkpoints import adapter_checkpoint, verified

    settings = plain_settings
    params: dict[str, str | bool] = {"merged": True} if kind == "merged" else {}
    params |= {"gguf": "f16"} if kind == "gguf" else {}
    with small_disk(settings.runs_dir, 24 * MiB) as disk:
        app = create_app(settings)
        with TestClient(app) as client:
            client.headers["Authorization"] = f"Bearer {app.state.first_key}"
            job_id, step = adapter_checkpoint(client, settings)  # about 6.5 MB
            folder = next(disk.rglob(f"step_{step:06d}"))
            before = _snapshot(folder)
            exports = folder.parent.parent / "exports"
            for midway in (False, True):  # refused before writing, or the disk fills midway
                if midway:  # the check up front passes: the writes themselves find no space
                    monkeypatch.setattr(checkpoints, "check_space", lambda target, needed: None)
                ballast = fill(disk, leave_bytes=256 * 1024)
                r = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download", params=params)
                assert r.status_code == 507, r.text
                error = r.json()["error"]
                assert error["code"] == "disk_full", error
                message = error["message"]
                assert str(exports) in message, message
                needed = int(message.split(" needs ", 1)[1].split(" bytes", 1)[0])
                free = int(message.split(" bytes,", 1)[1].split(" bytes are free", 1)[0])
                assert free < needed, message
                # nothing partial: no archive, no temporary file, no scratch folder
                left = [p.name for p in exports.iterdir() if not p.name.endswith(".lock")]
                assert left == [], left
                assert _snapshot(folder) == before
                listed = client.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
                assert [c["step"] for c in listed] == [step]
                ballast.unlink()
            monkeypatch.undo()
            r = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download", params=params)
            assert r.status_code == 200, r.text
            manifest = verified(r.content)
            assert ("config.json" in manifest) == (kind == "merged"), sorted(manifest)
            assert _snapshot(folder) == before
