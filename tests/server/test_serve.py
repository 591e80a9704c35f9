"""``roundhouse serve --with-worker``: what ``make run`` starts, as real processes on a real port."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import psutil
import pytest

from tests.engine.tiny import tiny_model_folder
from tests.utils import LOGIN_LINE, Process, child_env, free_port, roundhouse
from tests.utils.jobs import start_job, wait_for_job


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_serve_with_worker_prints_a_login_url_and_runs_a_job(tmp_path: Path, processes: int) -> None:
    home = tmp_path / "home"
    tiny_model_folder(home / "models" / "tiny")
    port = free_port()
    env = child_env(ROUNDHOUSE_HOME=str(home), ROUNDHOUSE_PORT=str(port))
    command = roundhouse("serve", "--with-worker", "--new-login-key", "--processes", str(processes))
    serve = Process(command, env=env, log=tmp_path / "serve.log").start()
    try:
        found = serve.wait_for_line(LOGIN_LINE, timeout=60)
        assert found is not None, serve.log.read_text()
        url = found.group(1)  # a one-time login link: the client goes on with its session cookie
        before = serve.log.read_text().split("Open: ", 1)[0]  # the link comes last, boxed
        assert " ready." in before and before.endswith("+\n|  Roundhouse is up. "), serve.tail(3000)
        # the API and the worker each say which confinement this box gives python graders
        said = [line for line in before.splitlines() if line.startswith("python graders: ")]
        assert len(said) == 2 and all(line.endswith("; confined") for line in said), serve.tail(3000)
        serve.wait_for_http(f"http://127.0.0.1:{port}/api/health", timeout=60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            r = client.get(url, follow_redirects=False)
            assert r.status_code == 303 and "roundhouse_session" in r.headers["set-cookie"]
            rows = [{"text": f"line {i} of a small corpus"} for i in range(16)]
            content = "".join(json.dumps(x) + "\n" for x in rows).encode()
            ds = client.post("/api/datasets", files={"file": ("t.jsonl", content)}).json()
            job = start_job(client, ds["id"])
            job = wait_for_job(client, job["id"], {"succeeded", "failed"}, timeout=120, logs=serve.tail)
            assert job["status"] == "succeeded", (job, serve.tail(3000))
            assert (home / "roundhouse.db").is_file() and (home / "broker" / "queue").is_dir()
            # the GPU stream: the first snapshot names this host's worker (a CPU host here, or GPUs)
            with client.stream("GET", "/api/gpus/stream") as r:
                lines = r.iter_lines()
                data = next(line for line in lines if line.startswith("data: "))
            (host,) = json.loads(data[6:])
            assert host["online"] and (host["gpu"] or host["message"].startswith("no GPU on this host"))
        children = serve.descendants()
        assert any("worker" in " ".join(c.cmdline()) for c in children)
    finally:
        stopped = serve.stop(signal.SIGINT, grace=60)
    assert stopped, f"serve did not stop within 60 s of SIGINT (killed)\n{serve.tail()}"
    # the worker it started (and the worker's pool) went down with it
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
