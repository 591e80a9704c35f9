"""Checkpoint downloads under load: parallel first downloads build each archive once and all get
the same complete body; a body is never cut short silently."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient

from server.downloads import byte_range
from server.services import checkpoints
from server.settings import Settings
from tests.utils import ROOT
from tests.utils.jobs import start_job

PARALLEL = 8
ROWS = [{"text": f"row {i}"} for i in range(8)]


def adapter_checkpoint(client: TestClient, settings: Settings) -> tuple[str, int]:
    """A job with one LoRA checkpoint on disk (a real adapter of the tiny model, padded to a few
    MB so that building its archive takes a while), recorded as the worker records it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    ds = client.post("/api/datasets", files={"file": ("rows.jsonl", content)}).json()
    job = start_job(client, ds["id"])
    step = 2
    folder = Path(job["config"]["output_dir"]) / "checkpoints" / f"step_{step:06d}"
    base = settings.models_dir / "tiny"
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    (folder / "padding.bin").write_bytes(os.urandom(6 << 20))
    (folder / "state").mkdir()
    (folder / "state" / "optimizer.pt").write_bytes(b"resume state, not part of a download")
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=step, path=str(folder), kind="adapter", metrics={})
    return job["id"], step


def verified(archive: bytes) -> dict[str, str]:
    """The manifest of a downloaded archive, after checking every file against it (paths inside
    its one top folder, which every member lies in, each with a real modification time)."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        every = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in every}
        assert len(tops) == 1 and every[0].isdir(), sorted(m.name for m in every)
        assert all(m.mtime > 0 for m in every)
        members = {m.name.split("/", 1)[1]: tar.extractfile(m) for m in every if m.isfile()}
        files = {name: f.read() for name, f in members.items() if f is not None}
    manifest = {}
    for line in files.pop("MANIFEST.sha256").decode().splitlines():
        digest, name = line.split("  ", 1)
        assert hashlib.sha256(files[name]).hexdigest() == digest, name
        manifest[name] = digest
    assert sorted(manifest) == sorted(files)
    return manifest


def in_parallel(count: int, call: Callable[[], Any]) -> list[Any]:
    """``call()`` from ``count`` threads released at the same moment; the results in order."""
    start = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:  # reported as the result
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("merged", [False, True], ids=["adapter", "merged"])
def test_parallel_first_downloads_all_get_the_same_complete_archive(
    client: TestClient, settings: Settings, merged: bool
) -> None:
    job_id, step = adapter_checkpoint(client, settings)
    url = f"/api/jobs/{job_id}/checkpoints/{step}/download"
    answers = in_parallel(PARALLEL, lambda: client.get(url, params={"merged": merged}))
    problems = [
        a if isinstance(a, Exception) else (a.status_code, a.text[:200] if a.is_error else "")
        for a in answers
    ]
    assert all(not isinstance(a, Exception) and a.status_code == 200 for a in answers), problems
    bodies = {a.content for a in answers}
    assert len(bodies) == 1, f"{len(bodies)} different bodies"
    (body,) = bodies
    assert all(int(a.headers["content-length"]) == len(body) for a in answers)
    manifest = verified(body)
    assert ("config.json" in manifest) == merged and ("adapter_config.json" in manifest) != merged
    assert not any(name.startswith("state/") for name in manifest)
    exports = next(settings.runs_dir.glob("*/exports"))
    assert not [p.name for p in exports.iterdir() if p.name.endswith((".tmp", ".tmp.tmp"))]
    again = client.get(url, params={"merged": merged})  # built once, then reused
    assert again.status_code == 200 and again.content == body
    part = client.get(url, params={"merged": merged}, headers={"Range": "bytes=100-199"})  # a resume
    assert part.status_code == 206 and part.content == body[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(body)}"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("bytes=0-9", (0, 10)),
        ("bytes=90-", (90, 100)),
        ("bytes=-10", (90, 100)),
        ("bytes=0-1000", (0, 100)),
        (None, None),
        ("bytes=100-", None),  # past the end: the whole file instead
        ("bytes=5-1", None),
        ("bytes=-0", None),
        ("bytes=-", None),
        ("bytes=0-1,5-6", None),  # several ranges are not served: the whole file
        ("items=0-9", None),
        ("bytes=" + "9" * 5000 + "-", None),  # too long for int(): ignored, not a 500
        ("bytes=0-" + "9" * 5000, None),
    ],
)
def test_byte_range(header: str | None, expected: tuple[int, int] | None) -> None:
    assert byte_range(header, 100) == expected


def test_a_download_is_never_cut_short_silently(client: TestClient, settings: Settings) -> None:
    """If the archive shrinks while it is sent, the response errors (the server drops the
    connection) instead of ending cleanly short of its Content-Length."""
    job_id, step = adapter_checkpoint(client, settings)
    url = f"/api/jobs/{job_id}/checkpoints/{step}/download"
    full = client.get(url)
    assert full.status_code == 200
    archive = next(settings.runs_dir.glob("*/exports/*.tar"))
    app = client.app
    token = client.headers["Authorization"].encode()
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": url,
        "raw_path": url.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"authorization", token)],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "extensions": {},
        "state": {},
    }
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) == 2:
            os.truncate(archive, len(full.content) // 2)  # the file shrinks after the first chunk

    async def call() -> None:
        await app(scope, receive, send)  # type: ignore[operator]

    with pytest.raises(Exception):  # noqa: B017 - any error: the server then drops the connection
        anyio.run(call)
    start = sent[0]
    assert start["status"] == 200
    length = int(dict(start["headers"])[b"content-length"])
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert length == len(full.content) and len(body) < length
    assert all(m.get("more_body", False) for m in sent[1:]), "the body was ended cleanly, short"


HOLD = """
import sys, time
from pathlib import Path
from server.services.checkpoints import _building_lock
with _building_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(2)
"""


def test_a_build_waits_for_the_same_build_in_another_server_process(tmp_path: Path) -> None:
    """``serve --processes N``: another process building the same archive holds it up."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"w" * 1000)
    target = tmp_path / "exports" / "a.tar"
    target.parent.mkdir()
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert other.stdout is not None and other.stdout.readline() == b"held\n"
        started = time.monotonic()
        checkpoints.build_archive(folder, target)
        waited = time.monotonic() - started
    finally:
        other.wait(timeout=30)
    assert waited > 1.0, f"built after {waited:.2f} s, while the other process held the build"
    assert verified(target.read_bytes()) == {"weights.bin": hashlib.sha256(b"w" * 1000).hexdigest()}
