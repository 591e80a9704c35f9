"""The storage seam's contract, the same tests for both backends: a folder (``LocalStorage``) and
an S3 API (``S3Storage`` against a real moto server)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.services import checkpoints, disk
from server.settings import Settings
from server.storage import LocalStorage, Storage, check_key, open_storage
from tests.utils.jobs import start_job
from tests.utils.s3 import S3Server, s3_server, s3_settings

__all__ = ["s3_server", "s3_settings"]  # fixtures used here


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield open_storage(Settings(home=tmp_path / "home"))
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        yield open_storage(Settings(home=tmp_path / "home", **server.settings()))


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_put_get_iter_exists_delete(storage: Storage, tmp_path: Path) -> None:
    source = tmp_path / "source.bin"
    source.write_bytes(b"a" * 3000)
    storage.put_file("datasets/x/a.jsonl", source)
    assert storage.put_stream("datasets/x/b.jsonl", io.BytesIO(b"bee\n")) == 4
    assert storage.exists("datasets/x/a.jsonl") and storage.exists("datasets/x")
    assert not storage.exists("datasets/y") and not storage.exists("datasets/x/c.jsonl")
    assert storage.list("datasets") == [("datasets/x/a.jsonl", 3000), ("datasets/x/b.jsonl", 4)]
    assert b"".join(storage.iter_bytes("datasets/x/a.jsonl", chunk=1000)) == b"a" * 3000
    target = tmp_path / "out" / "a.jsonl"
    storage.get_file("datasets/x/a.jsonl", target)
    assert target.read_bytes() == b"a" * 3000
    assert [p.name for p in target.parent.iterdir()] == ["a.jsonl"]  # no temporary file left
    with pytest.raises(FileNotFoundError):
        storage.get_file("datasets/x/nothing", tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):
        b"".join(storage.iter_bytes("datasets/x/nothing"))
    storage.delete("datasets/x/a.jsonl")
    storage.delete("datasets/x/a.jsonl")  # gone already: no error
    assert storage.list("datasets/x") == [("datasets/x/b.jsonl", 4)]
    assert storage.list("datasets/x/b") == []  # a folder, not a name's beginning


def test_trees_and_materialize(storage: Storage, tmp_path: Path) -> None:
    folder = tmp_path / "step_000002"
    (folder / "state").mkdir(parents=True)
    (folder / "adapter.safetensors").write_bytes(b"w" * 100)
    (folder / "state" / "optimizer.pt").write_bytes(b"o")
    storage.put_tree("runs/j1/checkpoints/step_000002", folder)
    storage.put_stream("runs/j1/train.log", io.BytesIO(b"log"))
    assert storage.list("runs/j1/checkpoints") == [
        ("runs/j1/checkpoints/step_000002/adapter.safetensors", 100),
        ("runs/j1/checkpoints/step_000002/state/optimizer.pt", 1),
    ]
    pulled = tmp_path / "pulled" / "ckpt"
    storage.get_tree("runs/j1/checkpoints/step_000002", pulled)
    assert tree(pulled) == tree(folder)
    assert [p.name for p in pulled.parent.iterdir()] == ["ckpt"]
    cache = tmp_path / "cache"
    local = storage.materialize("runs/j1/checkpoints/step_000002", cache)
    assert tree(local) == tree(folder)
    if storage.local_path("runs/j1") is None:
        assert local == cache / "runs" / "j1" / "checkpoints" / "step_000002"
        assert storage.materialize("runs/j1/checkpoints/step_000002", cache) == local  # pulled once
    else:
        assert local == storage.local_path("runs/j1/checkpoints/step_000002")
    with pytest.raises(FileNotFoundError):
        storage.materialize("runs/none", cache)
    storage.delete_prefix("runs/j1")
    assert storage.list("runs") == [] and not storage.exists("runs/j1")
    storage.delete_prefix("runs/j1")  # nothing there: no error


def test_presigned_url(storage: Storage) -> None:
    storage.put_stream("runs/j/exports/a.tar", io.BytesIO(b"tar bytes"))
    url = storage.presigned_url("runs/j/exports/a.tar", expires_s=60, filename="a.tar")
    if storage.local_path("runs/j/exports/a.tar") is not None:
        assert url is None
        return
    assert url is not None
    r = httpx.get(url)
    assert r.status_code == 200 and r.content == b"tar bytes"
    assert "a.tar" in r.headers["content-disposition"]


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../x", "runs/../../x", "runs//x", "runs/./x", "a\\b", "a\x00b"]
)
def test_bad_keys_are_refused(storage: Storage, key: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage key"):
        check_key(key)
    calls: list[Any] = [
        lambda: storage.put_stream(key, io.BytesIO(b"x")),
        lambda: storage.get_file(key, tmp_path / "x"),
        lambda: storage.exists(key),
        lambda: storage.delete(key),
        lambda: storage.local_path(key),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="storage key"):
            call()


def test_open_storage_picks_by_url(tmp_path: Path) -> None:
    local = open_storage(Settings(home=tmp_path))
    assert isinstance(local, LocalStorage) and local.url == tmp_path.resolve().as_uri()
    assert local.local_path("datasets/a/b.jsonl") == tmp_path.resolve() / "datasets" / "a" / "b.jsonl"
    with pytest.raises(ValueError, match="ROUNDHOUSE_STORAGE_URL"):
        open_storage(Settings(home=tmp_path, storage_url="ftp://host/x"))
    s3 = open_storage(Settings(home=tmp_path, storage_url="s3://bucket/some/prefix", s3_region="us-east-1"))
    assert s3.url == "s3://bucket/some/prefix" and s3.local_path("a") is None


def test_child_environment_carries_the_store() -> None:
    settings = Settings(
        storage_url="s3://b/p", s3_endpoint_url="http://minio:9000", storage_presigned_downloads=True
    )
    env = settings.child_environment()
    assert (
        env["ROUNDHOUSE_STORAGE_URL"] == "s3://b/p"
        and env["ROUNDHOUSE_S3_ENDPOINT_URL"] == "http://minio:9000"
    )
    assert Settings(
        **{k.removeprefix("ROUNDHOUSE_").lower(): v for k, v in env.items()}
    ).storage_presigned_downloads


# -- the service on an S3 store: uploads, previews, downloads and deletes go through it ------------
ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(6)
]


def s3_app(settings: Settings, server: S3Server) -> tuple[TestClient, Storage]:
    s3 = settings.model_copy(update=server.settings())
    app = create_app(s3)
    client = TestClient(app)
    client.headers["Authorization"] = f"Bearer {app.state.first_key}"
    return client, app.state.storage


def adapter_in_store(
    client: TestClient, settings: Settings, storage: Storage, dataset_id: str
) -> tuple[str, int]:
    """A queued job with a LoRA checkpoint (of the tiny model) in the store, recorded by key."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = start_job(client, dataset_id)
    assert job["config"]["output_dir"] == f"runs/{job['id']}"  # keys, not this host's paths
    assert job["config"]["data"]["train"].startswith("datasets/")
    folder = settings.home / "elsewhere" / "step_000002"
    base = settings.models_dir / "tiny"
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    (folder / "state").mkdir()
    (folder / "state" / "optimizer.pt").write_bytes(b"resume state, not part of a download")
    key = f"runs/{job['id']}/checkpoints/step_000002"
    storage.put_tree(key, folder)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(
            session, job_id=job["id"], step=2, path=key, kind="adapter", metrics={}, storage=storage
        )
    return job["id"], 2


def test_the_service_on_an_s3_store(
    settings: Settings, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.server.test_checkpoints import verified

    monkeypatch.setattr(disk, "TTL_S", 0.0)  # a job's size listed afresh each time

    client, storage = s3_app(settings, s3_server)
    with client:
        content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        r = client.post("/api/datasets", files={"file": ("chat.jsonl", content)})
        assert r.status_code == 201, r.text
        ds = r.json()
        ((key, size),) = storage.list("datasets")
        assert key == f"datasets/{ds['id']}/chat.jsonl" and size == len(content)
        assert not settings.datasets_dir.exists()  # nothing of it on this host but the cache
        assert client.post("/api/datasets", files={"file": ("bad.jsonl", b"{no\n")}).status_code == 422
        assert len(storage.list("datasets")) == 1  # an invalid upload stores nothing
        preview = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny", "limit": 2})
        assert preview.status_code == 200, preview.text
        assert [row["line"] for row in preview.json()["rows"]] == [1, 2]
        stats = client.get(f"/api/datasets/{ds['id']}/stats", params={"model": "tiny"}).json()
        assert stats["sampled"] == len(ROWS)
        r = client.get(f"/v1/files/file-{ds['id']}/content")
        assert r.status_code == 200 and r.content == content

        job_id, step = adapter_in_store(client, settings, storage, ds["id"])
        listed = client.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
        assert [c["step"] for c in listed] == [step]
        r = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download")
        assert r.status_code == 200, r.text
        manifest = verified(r.content)
        assert "adapter_model.safetensors" in manifest and not any(n.startswith("state/") for n in manifest)
        exports = [k for k, _ in storage.list(f"runs/{job_id}/exports")]
        assert exports == [f"runs/{job_id}/exports/{job_id[:8]}-step{step:06d}-adapter.tar"]
        assert client.get(f"/api/jobs/{job_id}").json()["disk_bytes"] == sum(
            s for _, s in storage.list(f"runs/{job_id}")
        )
        first = r.content
        merged = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download", params={"merged": "true"})
        assert merged.status_code == 200, merged.text
        assert "model.safetensors" in verified(merged.content)
        assert len(storage.list(f"runs/{job_id}/exports")) == 2
        assert client.delete(f"/api/jobs/{job_id}/checkpoints/{step}/merged").status_code == 204
        assert len(storage.list(f"runs/{job_id}/exports")) == 1  # the merged build is gone from the store

        app = client.app
        app.state.settings = app.state.settings.model_copy(update={"storage_presigned_downloads": True})  # type: ignore[attr-defined]
        r = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download", follow_redirects=False)
        assert r.status_code == 307, r.text
        fetched = httpx.get(r.headers["location"])
        assert fetched.status_code == 200 and fetched.content == first  # the stored archive
        r = client.get(f"/v1/files/file-{ds['id']}/content", follow_redirects=False)
        assert r.status_code == 307 and httpx.get(r.headers["location"]).content == content

        assert client.post(f"/api/jobs/{job_id}/cancel").status_code == 200
        assert client.delete(f"/api/jobs/{job_id}").status_code == 204
        assert storage.list(f"runs/{job_id}") == []
        assert client.delete(f"/api/datasets/{ds['id']}").status_code == 204
        assert storage.list("datasets") == []


def test_migration_0007_turns_paths_into_keys_and_back(database_url: str, tmp_path: Path) -> None:
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text

    from server.db import MIGRATIONS, make_engine

    home = tmp_path / "home"
    old = {
        "datasets": f"{home}/datasets/d1/train.jsonl",
        "jobs": f"{home}/runs/j1",
        "checkpoints": f"{home}/runs/j1/checkpoints/step_000002",
        "evaluations": f"{home}/runs/j1/checkpoints/step_000002/evaluations/e1.json",
    }
    keys = {table: value.removeprefix(f"{home}/") for table, value in old.items()}
    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["home"] = home
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0006")
        conn.execute(
            text(
                "INSERT INTO datasets (id, name, filename, path, format, rows, size_bytes, sha256,"
                " created_at) VALUES ('d1', 'd', 'train.jsonl', :p, 'chat', 1, 1, 'x', CURRENT_TIMESTAMP)"
            ),
            {"p": old["datasets"]},
        )
        conn.execute(
            text(
                "INSERT INTO datasets (id, name, filename, path, format, rows, size_bytes, sha256,"
                " created_at) VALUES ('d2', 'd', 'x.jsonl', '/somewhere/else.jsonl', 'chat', 1, 1, 'x',"
                " CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO jobs (id, name, status, base_model, dataset_id, config, output_dir, step,"
                " attempts, sends, retries, created_at) VALUES ('j1', 'j', 'succeeded', 'tiny', 'd1',"
                " '{}', :p, 0, 1, 1, 0, CURRENT_TIMESTAMP)"
            ),
            {"p": old["jobs"]},
        )
        conn.execute(
            text(
                "INSERT INTO checkpoints (job_id, step, path, kind, metrics, created_at)"
                " VALUES ('j1', 2, :p, 'adapter', '{}', CURRENT_TIMESTAMP)"
            ),
            {"p": old["checkpoints"]},
        )
        conn.execute(
            text(
                "INSERT INTO evaluations (id, job_id, step, dataset_id, status, max_rows, max_new_tokens,"
                " num_samples, metrics, path, created_at) VALUES ('e1', 'j1', 2, 'd1', 'succeeded', 1, 1, 1,"
                " '{}', :p, CURRENT_TIMESTAMP)"
            ),
            {"p": old["evaluations"]},
        )

    def stored() -> dict[str, str]:
        with engine.connect() as conn:
            found = {
                table: conn.execute(text(f"SELECT {column} FROM {table} ORDER BY id")).scalars().first()
                for table, column in (
                    ("datasets", "path"),
                    ("jobs", "output_dir"),
                    ("checkpoints", "path"),
                    ("evaluations", "path"),
                )
            }
            other = conn.execute(text("SELECT path FROM datasets WHERE id = 'd2'")).scalar()
        assert other == "/somewhere/else.jsonl"  # in no place of the layout: left as it was
        return found

    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0007")
    assert stored() == keys
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0006")
    assert stored() == {table: str(home.resolve() / key) for table, key in keys.items()}
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    engine.dispose()
