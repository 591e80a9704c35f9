"""Object store down: the S3 server SIGKILLed while a worker pushes checkpoints and while the API
serves downloads, then started again on the same port with the objects it had stored; and an
upload cut by a SIGKILL of the API, then the API started again.

The store is moto's S3 API as a real process that keeps a journal of the requests it received and
replays it when it starts (``tests.utils.s3_journal``): killed, its port refuses connections;
started again, it has every object it had acknowledged, as a MinIO restarted on its disk would.

- A job pushing a checkpoint every few steps, the store killed as a push begins and kept down
  for longer than one operation's retries, twice: the job waits (job events say that the store did
  not answer and when the push is tried again), goes on and succeeds; every checkpoint row names a
  whole checkpoint in the store (each object there, byte for byte the worker's files); a download
  asked while the store is down answers 503 ``storage_unavailable`` with a Retry-After.
- A dataset download (``GET /v1/files/{id}/content``) from a real ``roundhouse serve`` while the
  store is down answers 503; one whose store is killed mid-body drops the connection after fewer
  bytes than its Content-Length: the client sees an incomplete body, never a short 200.
- A large upload cut by a SIGKILL of the API while the body arrives, while the server copies it,
  and while it stores it: after the API starts again no partial file is left anywhere (the scratch
  folder, the datasets folder, the temporary folder) and no row names a missing file.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from server.storage import images
from server.storage.s3 import RETRY_S
from tests.server.conftest import WorkerProcess
from tests.server.test_durability import _settings, events
from tests.server.test_worker import ROWS, dataset, unpack
from tests.utils import Process, answers, child_env, free_port, roundhouse
from tests.utils.jobs import FINAL, start_job, wait_for, wait_for_job
from tests.utils.s3_journal import JournaledS3

pytestmark = pytest.mark.slow

# how long the store stays down: past one operation's retries (``RETRY_S``), so that a push gives
# up at least once and is tried again whole, with room for the next push to begin in the outage
DOWN_S = RETRY_S + 15
OUTAGES = 2
STEPS, EVERY = 60, 3  # a checkpoint every 3 steps: a push begins soon after the store is back
# a checkpoint file the store receives (a line of its journal)
CHECKPOINT_PUT = re.compile(rb'"method": "PUT", "url": "[^"]*/checkpoints/step_(\d+)/')


class Journal:
    """The requests the store received, read from its journal as they arrive."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def next_checkpoint_put(self, *, after: int, timeout: float, details: Callable[[], str]) -> int:
        """The step of the first checkpoint file put in the store, of a step after ``after``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.path.exists():
                with self.path.open("rb") as f:
                    f.seek(self.offset)
                    data = f.read()
                whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
                self.offset += len(whole)
                for found in CHECKPOINT_PUT.finditer(whole):
                    if int(found[1]) > after:
                        return int(found[1])
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint after step {after} was pushed\n{details()}")
            time.sleep(0.002)


def storage_unavailable(r: Any, *, openai: bool = False) -> None:
    """``r`` is the 503 of a store that does not answer: the one JSON error, with a Retry-After."""
    assert r.status_code == 503, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json")
    assert int(r.headers["retry-after"]) > 0
    error = r.json()["error"]
    assert error["code"] == "storage_unavailable", error
    assert "object store is unavailable" in error["message"], error
    if openai:
        assert error["type"] == "server_error", error


def objects(s3: JournaledS3, settings: Settings, key: str) -> dict[str, bytes]:
    """The store's objects under the folder ``key``, by name relative to it (each read whole)."""
    bucket, prefix = (settings.storage_url or "").removeprefix("s3://").split("/", 1)
    client, folder = s3.server.client(), f"{prefix}/{key}/"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder)
    names = [o["Key"] for page in pages for o in page.get("Contents", [])]
    found = {}
    for name in names:
        head = client.head_object(Bucket=bucket, Key=name)
        body = client.get_object(Bucket=bucket, Key=name)["Body"].read()
        assert head["ContentLength"] == len(body), name
        found[name[len(folder) :]] = body
    return found


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[JournaledS3]:
    server = JournaledS3(tmp_path / "s3").start()
    try:
        yield server
    finally:
        server.kill()


def test_a_store_killed_while_checkpoints_are_pushed_holds_the_job_up_and_loses_nothing(
    s3: JournaledS3, tmp_path: Path
) -> None:
    if not answers("127.0.0.1", 6379):
        pytest.skip("no Redis server answers on 127.0.0.1:6379 (make test starts one)")
    settings = _settings(tmp_path, **s3.server.settings())
    app = create_app(settings)
    worker = WorkerProcess(settings, tmp_path / "worker.log")

    def logs() -> str:
        return f"--- worker\n{worker.tail()}\n--- s3\n{s3.tail()}"

    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {app.state.first_key}"
        keep_last = 3
        job = start_job(
            client,
            dataset(client),
            hyper={"max_steps": STEPS},
            checkpoint={"every_steps": EVERY, "keep_last": keep_last},
        )
        job_id, journal = job["id"], Journal(s3.journal)
        worker.start()
        cuts: list[int] = []
        try:
            cut = 0
            for outage in range(OUTAGES):
                # killed as soon as a checkpoint's first file reaches it: that push is under way
                cut = journal.next_checkpoint_put(after=cut, timeout=240, details=logs)
                s3.kill()
                cuts.append(cut)
                time.sleep(DOWN_S)
                seen = client.get(f"/api/jobs/{job_id}").json()
                assert seen["status"] == "running", (outage, seen, logs())  # held up, not failed
                assert seen["step"] < STEPS, seen
                s3.start()
                # the push that was cut went through, whole (a row names it only then)
                wait_for(
                    lambda: client.get(f"/api/jobs/{job_id}/checkpoints").json()["data"],
                    until=lambda rows, cut=cut: any(c["step"] >= cut for c in rows),
                    timeout=240,
                    what=f"the checkpoint of step {cut} stored after outage {outage}",
                    details=logs,
                )
            done = wait_for_job(client, job_id, FINAL, timeout=600, logs=logs)
        finally:
            worker.stop(grace=20)
            worker.kill_group()
        assert done["status"] == "succeeded" and done["step"] == STEPS, (done, logs())
        assert s3.starts == OUTAGES + 1

        # each outage was waited out, and said so: a push (or its row's look at the store) retried
        retries = [e for e in events(client, job_id) if e["data"].get("storage_unavailable")]
        assert len(retries) >= OUTAGES, (retries, logs())
        assert all(re.search(r"checkpoint \S*step_\d{6}", e["message"]) for e in retries), retries
        assert all("the store did not answer" in e["message"] for e in retries), retries
        assert "try 2 in" in retries[0]["message"], retries[0]

        # every row, as the database holds it, names a whole checkpoint in the store: each object
        # there (HEAD), byte for byte the file the worker wrote; no row for a push not completed
        with sqlite3.connect(tmp_path / "roundhouse.db") as db:
            rows = db.execute(
                "SELECT step, path FROM checkpoints WHERE job_id = ? ORDER BY step", (job_id,)
            ).fetchall()
        listed = client.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
        assert [c["step"] for c in listed] == [step for step, _ in rows]  # none hidden as missing
        assert [step for step, _ in rows] == [STEPS - EVERY * i for i in reversed(range(keep_last))]
        local = settings.home / "runs" / job_id / "checkpoints"
        for step, path in rows:
            assert path == f"runs/{job_id}/checkpoints/step_{step:06d}", path
            stored = objects(s3, settings, path)
            folder = local / f"step_{step:06d}"
            files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
            assert set(stored) == set(files) and "adapter_model.safetensors" in stored, (step, sorted(stored))
            for name, body in stored.items():
                assert body == files[name].read_bytes(), (step, name)
        assert not [
            n
            for n in objects(s3, settings, f"runs/{job_id}/checkpoints")
            if n.split("/")[0] not in {f"step_{step:06d}" for step, _ in rows}
        ]  # nor a pruned or unrecorded checkpoint left in the store

        # a download while the store is down: 503, not a 500 and not a cut body
        s3.kill()
        storage_unavailable(client.get(f"/api/jobs/{job_id}/checkpoints"))
        storage_unavailable(client.get(f"/api/jobs/{job_id}/checkpoints/{STEPS}/download"))
        s3.start()
        r = client.get(f"/api/jobs/{job_id}/checkpoints/{STEPS}/download")
        assert r.status_code == 200, r.text[:500]
        manifest = unpack(r.content, tmp_path / "download")
        folder = local / f"step_{STEPS:06d}"
        digest = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert manifest["adapter_model.safetensors"] == digest
        print(f"store killed at the pushes of steps {cuts}; {len(retries)} retry events:")
        print("\n".join(e["message"][:300] for e in retries))


def _serve(settings: Settings, tmp_path: Path, name: str, **env: str) -> tuple[Process, str]:
    """``roundhouse serve`` on ``settings`` as a real process, once it answers; and its URL."""
    port = free_port()
    variables = child_env(**settings.child_environment(), **env)
    server = Process(roundhouse("serve", "--port", str(port)), env=variables, log=tmp_path / f"{name}.log")
    base = f"http://127.0.0.1:{port}"
    server.start().wait_for_http(f"{base}/api/health", timeout=90)
    return server, base


def test_a_download_from_a_store_that_is_down_or_dies_mid_body_is_never_a_complete_200(
    s3: JournaledS3, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'roundhouse.db'}", **s3.server.settings()
    )
    key = create_app(settings).state.first_key
    server, base = _serve(settings, tmp_path, "serve")
    small = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    # larger than every buffer between the store and the client (sockets, the server's chunks)
    large = (json.dumps({"text": "x" * 4000}) + "\n").encode() * 16_000
    try:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http:
            ids = {}
            for name, content in (("small", small), ("large", large)):
                r = http.post(
                    "/v1/files", data={"purpose": "fine-tune"}, files={"file": (f"{name}.jsonl", content)}
                )
                assert r.status_code == 200, r.text
                ids[name] = r.json()["id"]

            s3.kill()
            started = time.monotonic()
            storage_unavailable(http.get(f"/v1/files/{ids['small']}/content"), openai=True)
            assert time.monotonic() - started < RETRY_S + 30  # its retries are bounded
            assert http.get("/api/health").status_code == 200  # the server is not held up meanwhile
            s3.start()
            r = http.get(f"/v1/files/{ids['small']}/content")
            assert r.status_code == 200 and r.content == small

            # the store dies mid-body: the connection drops before Content-Length bytes
            received = 0
            with http.stream("GET", f"/v1/files/{ids['large']}/content") as r:
                assert r.status_code == 200
                assert int(r.headers["content-length"]) == len(large)
                chunks = r.iter_raw()
                received += len(next(chunks))
                s3.kill()
                with pytest.raises(httpx.RemoteProtocolError, match=r"incomplete|without sending complete"):
                    for chunk in chunks:
                        received += len(chunk)
            assert 0 < received < len(large)
            assert http.get("/api/health").status_code == 200
            s3.start()  # and the same download whole once the store is back
            r = http.get(f"/v1/files/{ids['large']}/content")
            assert (
                r.status_code == 200 and hashlib.sha256(r.content).digest() == hashlib.sha256(large).digest()
            )
    finally:
        server.stop(grace=20)
        server.kill_group()


def _multipart(
    content: bytes, *, sent: threading.Event, hold: threading.Event
) -> tuple[str, Iterator[bytes]]:
    """A multipart form with ``content`` as its file, sent in chunks; after half of them ``sent``
    is set and the rest waits for ``hold``. Returns its content type and its body."""
    boundary = "rh-cut-upload"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="rows.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()

    def body() -> Iterator[bytes]:
        yield head
        half, size = len(content) // 2, 1 << 20
        for start in range(0, len(content), size):
            if start >= half and not sent.is_set():
                sent.set()
                hold.wait(60)
            yield content[start : start + size]
        yield f"\r\n--{boundary}--\r\n".encode()

    return f"multipart/form-data; boundary={boundary}", body()


def test_an_upload_cut_by_a_killed_api_leaves_no_partial_file_after_the_restart(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'roundhouse.db'}")
    key = create_app(settings).state.first_key
    temp = tmp_path / "tmp"  # the server's temporary folder (the form parser spools the file there)
    temp.mkdir()
    incoming, stored = settings.cache_dir / "incoming", settings.datasets_dir
    content = (json.dumps({"text": "y" * 4000}) + "\n").encode() * 24_000  # 96 MB
    source = tmp_path / "rows.jsonl"
    source.write_bytes(content)

    def left() -> list[str]:
        """Files an upload left in the scratch folder, under datasets/ and in the temporary folder
        (not the image lock's file, which the API keeps there for good: ``server.storage.images``)."""
        found = [
            p
            for p in (incoming, stored, temp)
            if p.is_dir()
            for p in p.rglob("*")
            if p.is_file() and p.name != images.LOCK_FILE
        ]
        return sorted(str(p) for p in found)

    def body_arriving(base: str, server: Process) -> None:
        sent, hold = threading.Event(), threading.Event()
        kind, body = _multipart(content, sent=sent, hold=hold)
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            outcome: list[object] = []

            def post() -> None:
                try:
                    outcome.append(http.post("/api/datasets", content=body, headers={"content-type": kind}))
                except httpx.HTTPError as exc:
                    outcome.append(exc)

            poster = threading.Thread(target=post)
            poster.start()
            assert sent.wait(60)
            time.sleep(0.5)  # half of it arrived and was spooled
            server.kill()
            hold.set()
            poster.join(60)
        assert outcome and isinstance(outcome[0], httpx.HTTPError), outcome

    def upload_until(seen: Callable[[set[str]], bool]) -> Callable[[str, Process], None]:
        """A cut of an upload as soon as ``seen(files left before it)`` holds."""

        def cut(base: str, server: Process) -> None:
            known = set(left())

            def post() -> None:
                with (
                    httpx.Client(
                        base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
                    ) as http,
                    source.open("rb") as f,
                    pytest.raises(httpx.HTTPError),
                ):
                    http.post("/api/datasets", files={"file": ("rows.jsonl", f)})

            poster = threading.Thread(target=post)
            poster.start()
            wait_for(
                lambda: seen(known),
                timeout=120,
                interval=0.001,
                what="the upload's files",
                details=server.tail,
            )
            server.kill()
            poster.join(60)

        return cut

    def copying(known: set[str]) -> bool:  # the server copies the body into its scratch folder
        return any(p.stat().st_size > 0 for p in incoming.glob(".incoming-*")) if incoming.is_dir() else False

    def storing(known: set[str]) -> bool:  # the store writes the dataset's file
        return (
            any(p.is_file() and str(p) not in known for p in stored.rglob("*")) if stored.is_dir() else False
        )

    cuts = {"body": body_arriving, "copy": upload_until(copying), "store": upload_until(storing)}
    seen: list[str] = []
    for name, cut in cuts.items():
        for attempt in range(2):
            server, base = _serve(settings, tmp_path, f"serve-{name}-{attempt}", TMPDIR=str(temp))
            try:
                cut(base, server)
            finally:
                server.stop(grace=5)
            before = left()
            if name != "body":
                assert before, f"{name}: the cut left nothing to sweep"  # else it did not cut that
            server, base = _serve(settings, tmp_path, f"serve-{name}-{attempt}-again", TMPDIR=str(temp))
            try:
                with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as http:
                    rows = http.get("/api/datasets", params={"limit": 1000}).json()["data"]
            finally:
                server.stop(grace=20)
            named = {stored / row["id"] / row["filename"] for row in rows}
            # what is left is what the rows name, whole (a cut whose commit went through: a dataset)
            assert sorted(map(str, named)) == left(), (name, attempt, before, rows)
            for row in rows:
                path = stored / row["id"] / row["filename"]
                assert path.stat().st_size == row["size_bytes"] == len(content), row
            seen.append(f"{name}: left {[Path(p).name for p in before]}, {len(rows)} dataset(s) after")
    print("\n".join(seen))
