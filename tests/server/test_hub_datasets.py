"""Dataset pulls from a local server that speaks the Hub's API: a transfer like a model pull.

The API reads the split's file list only: an unknown split or repo is a 404, a split over the
upload limit a 413 and one the disk cannot hold a 409, all before a byte of it moves. A worker's
Hub thread (the real ``runner`` loop, in this process; a real worker process where one is killed)
downloads the files with progress over SSE, joins them and stores them exactly like an upload,
with their source: the Hub's Parquet conversion when the repo has no file for the split, a
broken split failed with its bad lines. One split at one commit is one pull; a cancel or a full
disk leaves nothing; a worker killed mid-download resumes. The CLI does the same, and names
``ROUNDHOUSE_HUB_ENDPOINT`` when the Hub cannot be reached."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast, get_args

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.hf_hub import runner
from server.schemas import TransferKind
from server.services import transfers
from server.settings import Settings
from tests.server.conftest import WorkerProcess
from tests.server.test_hub_models import api, fill_up, progress_events, settings_for
from tests.utils import child_env, free_port, roundhouse
from tests.utils.fake_hub import FakeHub
from tests.utils.filesystems import fill, small_disk
from tests.utils.jobs import wait_for

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(6)
]


def jsonl(rows: Sequence[Mapping[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def long_rows(n: int, *, width: int = 1000) -> bytes:
    return jsonl(
        [
            {
                "messages": [
                    {"role": "user", "content": f"{i} " + "q" * width},
                    {"role": "assistant", "content": "a"},
                ]
            }
            for i in range(n)
        ]
    )


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub().start()
    broken = [*ROWS[:2], {"messages": [{"role": "user", "content": "no answer"}]}, *ROWS[2:]]
    repo = fake.add(
        "org/chat",
        {
            "README.md": b"# data",
            "data/train-00000-of-00002.jsonl": jsonl(ROWS[:3]),
            "data/train-00001-of-00002.jsonl": jsonl(ROWS[3:]),
            "data/test-00000-of-00001.jsonl": jsonl(broken),
        },
        kind="dataset",
    )
    repo.revisions["v1"] = {"data/train-00000-of-00001.jsonl": jsonl(ROWS[:4])}
    table = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]), table
    )
    repo = fake.add("org/converted", {"README.md": b"# only a card"}, kind="dataset")
    repo.revisions["refs/convert/parquet"] = {"default/train/0000.parquet": table.getvalue()}
    yield fake
    fake.stop()


@contextlib.contextmanager
def hub_thread(settings: Settings, client: TestClient) -> Iterator[None]:
    """A worker's Hub thread (``runner.loop``, as ``roundhouse worker`` starts it) on the app's
    database, stopped at the end."""
    stop, app = threading.Event(), cast(FastAPI, client.app)
    thread = runner.start(settings, app.state.sessions, worker_id=f"test-{uuid.uuid4().hex[:8]}", stop=stop)
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=60)


def pull(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/api/datasets/pulls", json=body)
    assert r.status_code == 202, r.text
    return dict(r.json())


def staged(settings: Settings) -> list[Path]:
    folder = settings.cache_dir / "dataset-pulls"
    return sorted(folder.rglob("*")) if folder.is_dir() else []


def test_a_split_is_pulled_by_a_worker_with_progress_and_stored_with_its_source(
    tmp_path: Path, hub: FakeHub
) -> None:
    assert get_args(TransferKind) == transfers.KINDS  # the API's kinds are the service's
    settings = settings_for(tmp_path, hub)
    with api(settings) as client:
        queued = pull(client, repo_id="org/chat", split="train")
        assert queued["kind"] == "dataset_pull" and queued["status"] == "queued", queued
        assert queued["options"] == {"split": "train", "config": None, "name": None}
        assert [f["path"] for f in queued["files"]] == [
            "data/train-00000-of-00002.jsonl",
            "data/train-00001-of-00002.jsonl",
        ]
        assert queued["bytes_total"] == len(jsonl(ROWS)) and queued["target"] == "org/chat (train)"
        assert hub.served_bytes("org/chat") == 0  # the file list only, so far
        with hub_thread(settings, client):
            events = progress_events(client, queued["id"])
            done = [e["bytes_done"] for e in events]
            assert events[-1]["status"] == "succeeded", events[-1]
            assert done == sorted(done) and done[-1] == queued["bytes_total"]
            stored = client.get(f"/api/datasets/{events[-1]['dataset_id']}").json()
            assert stored["rows"] == 6 and stored["format"] == "chat", stored
            assert stored["filename"] == "chat-train.jsonl" and stored["name"] == "org/chat (train)"
            source = stored["source"]
            assert source["hub"] == "org/chat" and source["split"] == "train" and source["from"] == "repo"
            assert source["sha"] == queued["commit"] and source["files"] == [
                f["path"] for f in queued["files"]
            ]

            converted = pull(client, repo_id="org/converted", split="train", name="converted")
            final = wait_for(
                lambda: client.get(f"/api/transfers/{converted['id']}").json(),
                until={"succeeded"},
                fail_on={"failed", "cancelled"},
                timeout=60,
            )
            stored = client.get(f"/api/datasets/{final['dataset_id']}").json()
            assert stored["rows"] == 5 and stored["name"] == "converted", stored
            assert stored["source"]["from"] == "parquet-conversion"

            broken = pull(client, repo_id="org/chat", split="test")
            failed = wait_for(
                lambda: client.get(f"/api/transfers/{broken['id']}").json(),
                until={"failed"},
                fail_on={"succeeded", "cancelled"},
                timeout=60,
            )
            assert failed["error_code"] == "invalid_dataset" and failed["dataset_id"] is None, failed
            assert "1 invalid row(s), nothing was stored: line 3:" in failed["error"], failed
            assert [d["line"] for d in failed["details"]] == [3], failed

        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "validation"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "split", r.text
        assert "'validation'" in r.json()["error"]["message"]
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/none", "split": "train"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "repo_id", r.text
        assert len(client.get("/api/datasets").json()["data"]) == 2
        listed = client.get("/api/transfers", params={"kind": "dataset_pull"}).json()["data"]
        assert [t["status"] for t in listed] == ["failed", "succeeded", "succeeded"]
        assert client.get("/api/models/pulls").json()["data"] == []  # model pulls only
        assert staged(settings) == []


def test_a_split_over_the_upload_limit_or_the_disk_is_refused_before_a_byte_moves(
    tmp_path: Path, hub: FakeHub
) -> None:
    size, before = len(jsonl(ROWS)), hub.served_bytes("org/chat")
    with api(settings_for(tmp_path, hub, max_upload_bytes=size - 1)) as client:
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "train"})
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "too_large" and error["param"] == "split", error
        assert f"org/chat split 'train' is {size:,} bytes (2 files)" in error["message"], error
        assert (
            "ROUNDHOUSE_MAX_UPLOAD_BYTES" in error["message"] and "nothing was downloaded" in error["message"]
        )
    with api(settings_for(tmp_path, hub, hub_keep_free_bytes=1 << 62)) as client:
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "train"})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_disk" and error["param"] == "split", error
        assert "ROUNDHOUSE_HUB_KEEP_FREE_BYTES" in error["message"], error
        assert client.get("/api/transfers").json()["data"] == []
    assert hub.served_bytes("org/chat") == before  # the file list only


def test_one_split_at_one_commit_is_one_pull_and_a_queued_cancel_leaves_nothing(
    tmp_path: Path, hub: FakeHub
) -> None:
    settings = settings_for(tmp_path, hub)
    with api(settings) as client:
        first = pull(client, repo_id="org/chat", split="train")
        again = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "train"})
        assert again.status_code == 200 and again.json()["id"] == first["id"], again.text
        by_commit = client.post(
            "/api/datasets/pulls", json={"repo_id": "org/chat", "split": "train", "revision": first["commit"]}
        )
        assert by_commit.status_code == 200 and by_commit.json()["id"] == first["id"], by_commit.text
        other = pull(client, repo_id="org/chat", split="train", revision="v1")
        assert other["id"] != first["id"] and other["revision"] == "v1", other
        assert other["commit"] != first["commit"]
        assert [f["path"] for f in other["files"]] == ["data/train-00000-of-00001.jsonl"]
        for t in (first, other):
            r = client.post(f"/api/transfers/{t['id']}/cancel")
            assert r.json()["status"] == "cancelled", r.text
        assert staged(settings) == [] and client.get("/api/datasets").json()["data"] == []


def test_a_disk_that_fills_mid_pull_fails_it_naming_the_disk_and_leaves_nothing(
    tmp_path: Path, hub: FakeHub
) -> None:
    """The cache folder is a small real disk. A split it cannot hold twice (downloaded, then
    copied as an upload) is refused at once; one that fits, on a disk something else fills while
    it downloads, fails (``disk_full``) naming the folder, the bytes it needs and the bytes free,
    leaving no file and no dataset; once space is freed the same pull succeeds."""
    data = long_rows(1000)
    hub.add("org/long", {"data/train-00000-of-00001.jsonl": data}, kind="dataset")
    settings = settings_for(tmp_path, hub)
    with small_disk(settings.cache_dir, 4 << 20) as disk, api(settings) as client:
        ballast = fill(disk, leave_bytes=len(data) + 256 * 1024)
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/long", "split": "train"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "insufficient_disk", r.text
        assert (
            f"needs {2 * len(data):,} bytes more in the cache folder {disk}" in r.json()["error"]["message"]
        )
        ballast.unlink()
        hub.bytes_per_s = 100_000  # about 10 s: the disk fills well before the file is whole
        try:
            with hub_thread(settings, client):
                queued = pull(client, repo_id="org/long", split="train")
                get = lambda: client.get(f"/api/transfers/{queued['id']}").json()  # noqa: E731
                wait_for(get, until=lambda t: t["bytes_done"] > 0, timeout=60)
                ballast = fill_up(disk)  # the disk fills while the rows arrive
                failed = wait_for(get, until={"failed"}, fail_on={"succeeded"}, timeout=60)
                assert failed["error_code"] == "disk_full", failed
                error = failed["error"]
                assert f"disk full: {disk / 'dataset-pulls'}" in error and "files were removed" in error, (
                    error
                )
                needed = int(error.split(" needs ", 1)[1].split(" bytes", 1)[0])
                free = int(error.split("), ", 1)[1].split(" bytes", 1)[0])
                assert needed == 2 * len(data) and free < needed, error
                assert staged(settings) == [] and client.get("/api/datasets").json()["data"] == []
                ballast.unlink()
                hub.bytes_per_s = None
                again = pull(client, repo_id="org/long", split="train")
                get = lambda: client.get(f"/api/transfers/{again['id']}").json()  # noqa: E731
                wait_for(get, until={"succeeded"}, fail_on={"failed", "cancelled"}, timeout=60)
                assert [d["rows"] for d in client.get("/api/datasets").json()["data"]] == [1000]
                assert staged(settings) == []
        finally:
            hub.bytes_per_s = None


def test_the_cli_pull_names_the_endpoint_setting_when_the_hub_cannot_be_reached(
    tmp_path: Path, hub: FakeHub
) -> None:
    settings = settings_for(tmp_path, hub, hub_endpoint=f"http://127.0.0.1:{free_port()}")
    done = subprocess.run(
        roundhouse("datasets", "pull", "org/chat", "--split", "train"),
        env=child_env(**settings.child_environment()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("org/chat: the Hub at http://127.0.0.1:"), done.stderr
    assert "ROUNDHOUSE_HUB_ENDPOINT" in done.stderr and "Connection refused" in done.stderr, done.stderr


@pytest.mark.slow
def test_a_killed_worker_resumes_a_dataset_pull_and_the_cli_follows_one(tmp_path: Path, hub: FakeHub) -> None:
    """A real worker process killed mid-download: the next one resumes the pull without fetching
    what was on disk again. Then the CLI pulls a split and prints its progress and the dataset,
    and a pull cancelled mid-download leaves nothing."""
    files = {f"data/train-0000{i}-of-00002.jsonl": long_rows(250, width=1200) for i in range(2)}
    hub.add("org/slow", files, kind="dataset")
    settings = settings_for(tmp_path, hub)
    hub.bytes_per_s = 100_000
    try:
        with api(settings) as client:
            worker = WorkerProcess(settings, tmp_path / "worker.log").start()
            queued = pull(client, repo_id="org/slow", split="train")
            get = lambda: client.get(f"/api/transfers/{queued['id']}").json()  # noqa: E731
            wait_for(
                get, until=lambda t: t["bytes_done"] > 0.3 * t["bytes_total"], timeout=60, details=worker.tail
            )
            worker.stop(signal.SIGKILL, grace=0)
            worker.kill_group()
            at_kill = get()["bytes_done"]
            worker = WorkerProcess(settings, tmp_path / "worker2.log").start()
            try:
                final = wait_for(
                    get, until={"succeeded"}, fail_on={"failed", "cancelled"}, timeout=90, details=worker.tail
                )
                served = hub.served_bytes("org/slow")
                assert final["attempts"] == 2 and at_kill > 0, final
                # what was on disk at the kill was not fetched again (a chunk in flight may be)
                total = final["bytes_total"]
                assert served < total + at_kill // 2 and served - total <= 256 * 1024, (
                    served,
                    total,
                    at_kill,
                )
                assert client.get(f"/api/datasets/{final['dataset_id']}").json()["rows"] == 500

                hub.bytes_per_s = None
                done = subprocess.run(
                    roundhouse("datasets", "pull", "org/chat", "--split", "train", "--name", "by the CLI"),
                    env=child_env(**settings.child_environment()),
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert done.returncode == 0, (done.stdout, done.stderr, worker.tail())
                assert "pulling org/chat split 'train'" in done.stdout and "succeeded" in done.stdout, (
                    done.stdout
                )
                assert "org/chat: dataset " in done.stdout and "(by the CLI, commit " in done.stdout, (
                    done.stdout
                )
                names = {d["name"]: d["rows"] for d in client.get("/api/datasets").json()["data"]}
                assert names["by the CLI"] == 6, names

                hub.bytes_per_s = 40_000
                again = pull(
                    client, repo_id="org/slow", split="train", revision=final["commit"], name="again"
                )
                get = lambda: client.get(f"/api/transfers/{again['id']}").json()  # noqa: E731
                wait_for(get, until=lambda t: t["bytes_done"] > 0, timeout=60, details=worker.tail)
                r = client.post(f"/api/transfers/{again['id']}/cancel")
                assert r.json()["status"] in ("cancelling", "cancelled"), r.text
                wait_for(get, until={"cancelled"}, timeout=30, details=worker.tail)
                assert staged(settings) == [] and "again" not in {
                    d["name"] for d in client.get("/api/datasets").json()["data"]
                }
            finally:
                worker.end()
    finally:
        hub.bytes_per_s = None
