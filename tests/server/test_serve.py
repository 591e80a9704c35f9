"""``roundhouse serve --with-worker``: what ``make run`` starts, as real processes on a real port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.engine.tiny import tiny_model_folder

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("processes", [1, 2])
def test_serve_with_worker_prints_a_login_url_and_runs_a_job(tmp_path: Path, processes: int) -> None:
    home = tmp_path / "home"
    tiny_model_folder(home / "models" / "tiny")
    port = free_port()
    env = dict(os.environ, ROUNDHOUSE_HOME=str(home), ROUNDHOUSE_PORT=str(port), HF_HUB_OFFLINE="1")
    env.pop("ROUNDHOUSE_REDIS_URL", None)
    env.pop("ROUNDHOUSE_DATABASE_URL", None)
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--with-worker",
            "--new-login-key",
            "--processes",
            str(processes),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            found = re.search(
                r"Open: (http://\S+/login\?token=(rh_\S+))", (tmp_path / "serve.log").read_text()
            )
            url = found.group(1) if found else None
            time.sleep(0.2)
        assert url is not None and found is not None, (tmp_path / "serve.log").read_text()
        key = found.group(2)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            while True:
                try:
                    r = client.get(url, follow_redirects=False)
                    break
                except httpx.ConnectError:
                    time.sleep(0.2)
            assert r.status_code == 303 and "roundhouse_key" in r.headers["set-cookie"]
            client.headers["Authorization"] = f"Bearer {key}"
            rows = [{"text": f"line {i} of a small corpus"} for i in range(16)]
            content = "".join(json.dumps(x) + "\n" for x in rows).encode()
            ds = client.post("/api/datasets", files={"file": ("t.jsonl", content)}).json()
            body = {
                "base_model": "tiny",
                "dataset_id": ds["id"],
                "hyper": {"max_steps": 2, "batch_size": 4},
                "engine": {"num_microbatches": 2},
                "checkpoint": {"every_steps": 2},
            }
            job = client.post("/api/jobs", json=body).json()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                job = client.get(f"/api/jobs/{job['id']}").json()
                if job["status"] in ("succeeded", "failed"):
                    break
                time.sleep(0.3)
            assert job["status"] == "succeeded", (job, (tmp_path / "serve.log").read_text()[-3000:])
            assert (home / "roundhouse.db").is_file() and (home / "broker" / "queue").is_dir()
            # the GPU stream: the first snapshot names this host's worker (a CPU host here, or GPUs)
            with client.stream("GET", "/api/gpus/stream") as r:
                lines = r.iter_lines()
                data = next(line for line in lines if line.startswith("data: "))
            (host,) = json.loads(data[6:])
            assert host["online"] and (host["gpu"] or host["message"].startswith("no GPU on this host"))
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("worker" in " ".join(c.cmdline()) for c in children)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    # the worker it started (and the worker's pool) went down with it
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
