"""An S3 server that can be stopped for real and started again with its objects, for the fault
tests: moto's S3 API as a process that appends every request it receives to a journal (moto's
recorder) and, when it starts, replays the journal into itself before it listens, as MinIO finds
its objects on its disk again.

``JournaledS3.kill()`` SIGKILLs the process: connections to its port are refused until
``start()`` brings it back on the same port with every object it had stored (a request that it
received but died before answering may have been applied too, as with a real store).
Multipart uploads are replayed under the upload ids the new process gives them.

The server itself: ``python -m tests.utils.s3_journal PORT JOURNAL``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode, urlsplit

from tests.utils.processes import Process, answers, child_env, free_port
from tests.utils.s3 import S3Server

UPLOAD_ID = re.compile(rb"<UploadId>([^<]+)</UploadId>")


def replay(app: Any, journal: Path) -> tuple[int, int]:
    """Send every request of ``journal`` to the WSGI ``app`` in order; ``(replayed, failed)``. A
    last line cut short (the process was killed while writing it) is left out."""
    from werkzeug.test import Client

    client = Client(app)
    uploads: dict[str, str] = {}  # a recorded multipart upload id -> the one the app gave it now
    created: dict[str, list[str]] = {}  # by object path: ids created now that no recorded id has yet
    done = failed = 0
    with journal.open("rb") as lines:
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            raw = entry.get("body") or ""
            body = base64.b64decode(raw) if entry.get("body_encoded") else raw.encode()
            url = urlsplit(entry["url"])
            query = parse_qsl(url.query, keep_blank_values=True)
            recorded = dict(query).get("uploadId")
            if recorded is not None and recorded not in uploads and created.get(url.path):
                uploads[recorded] = created[url.path].pop(0)
            query = [(k, uploads.get(v, v) if k == "uploadId" else v) for k, v in query]
            headers = {k: v for k, v in entry["headers"].items() if k.lower() != "transfer-encoding"}
            try:
                response = client.open(
                    url.path,
                    method=entry["method"],
                    query_string=urlencode(query),
                    headers=headers,
                    data=body,
                    base_url=f"{url.scheme}://{url.netloc}",
                )
            except Exception:  # a request the store refused then too
                failed += 1
                continue
            done += 1
            if entry["method"] == "POST" and "uploads" in dict(query):
                found = UPLOAD_ID.search(response.get_data())
                if found is not None:
                    created.setdefault(url.path, []).append(found[1].decode())
    return done, failed


def serve(port: int, journal: Path) -> None:
    """moto's S3 API on 127.0.0.1:``port``, after replaying ``journal``; every request it receives
    is appended to ``journal`` (one at a time: the lines of concurrent requests do not mix)."""
    os.environ.update(MOTO_ENABLE_RECORDING="true", MOTO_RECORDER_FILEPATH=str(journal), MOTO_PORT=str(port))
    from moto.moto_api import recorder
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    record = recorder._record_request

    def one_at_a_time(*args: Any, **kwargs: Any) -> None:
        with lock:
            record(*args, **kwargs)

    recorder._record_request = one_at_a_time  # type: ignore[method-assign]
    if journal.exists():
        recorder.stop_recording()
        done, failed = replay(app, journal)
        print(f"replayed {done} requests of {journal} ({failed} failed)", flush=True)
    recorder.start_recording()
    run_simple("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)


class JournaledS3:
    """The journaled server as a process on a port of its own, with its journal and log in
    ``folder``: ``start()``, ``kill()`` (SIGKILL: the store stops for real), ``start()`` again."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.journal = folder / "s3-journal.jsonl"
        self.server = S3Server(f"http://127.0.0.1:{self.port}")
        args = [sys.executable, "-m", "tests.utils.s3_journal", str(self.port), str(self.journal)]
        self.process = Process(args, env=child_env(), log=folder / "s3.log")
        self.starts = 0

    @property
    def endpoint_url(self) -> str:
        return self.server.endpoint_url

    def start(self, *, timeout: float = 120.0) -> Self:
        """Start it (replaying the journal) and wait until its port accepts connections.

        Raises:
            RuntimeError: it exited, or did not listen within ``timeout`` s; with its log's tail.
        """
        self.process.start()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while not answers("127.0.0.1", self.port):
            if not self.process.running() or time.monotonic() > deadline:
                raise RuntimeError(f"the S3 server did not start:\n{self.process.tail()}")
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        """SIGKILL it and wait until its port refuses connections."""
        self.process.kill()
        self.process.kill_group()
        while answers("127.0.0.1", self.port):
            time.sleep(0.05)

    def running(self) -> bool:
        return self.process.running()

    def tail(self) -> str:
        return self.process.tail()


if __name__ == "__main__":
    serve(int(sys.argv[1]), Path(sys.argv[2]))
