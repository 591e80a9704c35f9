"""Model pulls from a local server that speaks the Hub's API (``tests/utils/fake_hub.py``), through
the real ``huggingface_hub`` client: refusals before any weight moves (gated, unknown repo or
revision, an architecture the engine cannot train, not enough disk, offline, a Hub that cannot be
reached, from the API and the CLI), one pull per repo and commit, a sharded model pulled by a real
worker with monotone progress, then trained; a cancel that leaves nothing, and a worker killed
mid-download whose pull resumes without fetching a byte twice."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.settings import Settings
from tests.engine.tiny import tiny_model, tiny_tokenizer
from tests.server.conftest import WorkerProcess
from tests.server.test_worker import dataset
from tests.utils import child_env, free_port, roundhouse
from tests.utils.fake_hub import FakeHub
from tests.utils.filesystems import small_disk
from tests.utils.jobs import start_job, wait_for, wait_for_job

TOKEN = "hf_test_token"
TIMEOUT_S = 120


def sharded_model(folder: Path) -> Path:
    """A tiny Llama in several safetensors shards with its index and tokenizer, plus the duplicate
    weights a pull must skip (``.bin``, ``.gguf``, a subfolder)."""
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=max(96, len(tokenizer)))
    model.save_pretrained(folder, max_shard_size="100KB")
    tokenizer.save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 300_000)
    (folder / "model.gguf").write_bytes(b"\0" * 200_000)
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.pth").write_bytes(b"\0" * 100_000)
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    fake = FakeHub(token=TOKEN).start()
    folder = sharded_model(tmp_path_factory.mktemp("repo") / "tiny")
    fake.add_folder("org/tiny", folder)
    fake.add_folder("org/gated", folder, gated=True)
    bert = {"architectures": ["BertForMaskedLM"], "model_type": "bert"}
    fake.add("org/bert", {"config.json": json.dumps(bert).encode(), "model.safetensors": b"\0" * 3_000_000})
    yield fake
    fake.stop()


def settings_for(tmp_path: Path, hub: FakeHub, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "home": tmp_path / "home",
        "database_url": f"sqlite:///{tmp_path / uuid.uuid4().hex}.db",
        "queue": f"t-{uuid.uuid4().hex}",
        "hub_endpoint": hub.url,
        "hub_token": TOKEN,
        "hub_keep_free_bytes": 0,
        "lease_seconds": 3.0,
        "telemetry_seconds": 0.5,
    }
    return Settings(**(values | overrides))


def api(settings: Settings) -> TestClient:
    app = create_app(settings)
    client = TestClient(app)
    client.headers["Authorization"] = f"Bearer {app.state.first_key}"
    return client


def weights_served(hub: FakeHub, repo: str) -> int:
    return sum(
        n for key, n in hub.served.items() if key.startswith(repo + "/") and key.endswith(".safetensors")
    )


def test_pulls_are_refused_before_any_weight_moves(tmp_path: Path, hub: FakeHub) -> None:
    with api(settings_for(tmp_path, hub, hub_token=None)) as client:
        r = client.post("/api/models/pulls", json={"repo_id": "org/gated"})
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["code"] == "hub_gated" and error["param"] == "repo_id"
        assert (
            "accept its licence on the Hub" in error["message"] and "ROUNDHOUSE_HUB_TOKEN" in error["message"]
        )
    with api(settings_for(tmp_path, hub)) as client:
        r = client.post("/api/models/pulls", json={"repo_id": "org/missing"})
        assert r.status_code == 404 and "org/missing" in r.json()["error"]["message"], r.text
        r = client.post("/api/models/pulls", json={"repo_id": "org/tiny", "revision": "v9"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "revision", r.text
        assert "v9" in r.json()["error"]["message"]
        r = client.post("/api/models/pulls", json={"repo_id": "org/bert"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "unsupported_model"
        assert "unsupported architecture BertForMaskedLM" in r.json()["error"]["message"]
        assert 0 < hub.served_bytes("org/bert") < 1 << 20  # config.json only
        r = client.post("/api/models/pulls", json={"repo_id": "not a repo"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "repo_id"
        assert client.get("/api/models/pulls").json()["data"] == []
    before = weights_served(hub, "org/tiny")
    with api(settings_for(tmp_path, hub, hub_keep_free_bytes=1 << 62)) as client:
        r = client.post("/api/models/pulls", json={"repo_id": "org/tiny"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "insufficient_disk", r.text
        assert (
            "bytes" in r.json()["error"]["message"]
            and "nothing was downloaded" in r.json()["error"]["message"]
        )
    assert weights_served(hub, "org/tiny") == before
    with api(settings_for(tmp_path, hub, hub_offline=True)) as client:
        r = client.post("/api/models/pulls", json={"repo_id": "org/tiny"})
        assert r.status_code == 409 and "ROUNDHOUSE_HUB_OFFLINE" in r.json()["error"]["message"], r.text


def test_an_unreachable_hub_is_a_424_naming_the_endpoint_setting(tmp_path: Path, hub: FakeHub) -> None:
    with api(settings_for(tmp_path, hub, hub_endpoint=f"http://127.0.0.1:{free_port()}")) as client:
        r = client.post("/api/models/pulls", json={"repo_id": "org/tiny"})
        assert r.status_code == 424, r.text
        error = r.json()["error"]
        assert error["code"] == "hub_unreachable" and "ROUNDHOUSE_HUB_ENDPOINT" in error["message"]
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "train"})
        assert r.status_code == 424 and r.json()["error"]["code"] == "hub_unreachable", r.text
        documented = client.get("/openapi.json").json()["paths"]["/api/models/pulls"]["post"]["responses"]
        assert "424" in documented and not any(code.startswith("5") for code in documented)


def test_two_pulls_become_one_and_a_queued_cancel_leaves_nothing(tmp_path: Path, hub: FakeHub) -> None:
    settings = settings_for(tmp_path, hub)
    with api(settings) as client:
        first = client.post("/api/models/pulls", json={"repo_id": "org/tiny"})
        assert first.status_code == 201, first.text
        second = client.post("/api/models/pulls", json={"repo_id": "org/tiny"})
        assert second.status_code == 200 and second.json()["id"] == first.json()["id"]
        pull = first.json()
        assert pull["status"] == "queued" and pull["bytes_total"] == sum(f["size"] for f in pull["files"])
        names = {f["path"] for f in pull["files"]}
        assert "config.json" in names and "model.safetensors.index.json" in names
        assert not any(n.endswith((".bin", ".gguf", ".pth")) or "/" in n for n in names)
        r = client.post(f"/api/transfers/{pull['id']}/cancel")
        assert r.json()["status"] == "cancelled"
        assert not any((settings.models_dir / ".pulls").iterdir())
        assert "org/tiny" not in {m["name"] for m in client.get("/api/models").json()["data"]}


def test_a_pull_at_another_commit_is_refused_while_one_runs_and_the_same_commit_is_that_pull(
    tmp_path: Path, hub: FakeHub
) -> None:
    """Both commits would become the one folder ``models/org/revised``: a pull of another revision
    is a 409 naming both commits and the running pull; the same commit, by any name, is that pull;
    once it is cancelled the other revision is a pull of its own."""
    repo = hub.add_folder("org/revised", _repo_folder(hub, "org/tiny", tmp_path))
    config = json.loads(repo.files["config.json"])
    repo.revisions["v1"] = {
        **repo.files,
        "config.json": json.dumps({**config, "torch_dtype": "float32"}).encode(),
    }
    repo.revisions["refs/pr/1"] = repo.revisions["v1"]
    with api(settings_for(tmp_path, hub)) as client:
        first = client.post("/api/models/pulls", json={"repo_id": "org/revised"})
        assert first.status_code == 201, first.text
        main, v1 = repo.sha("main"), repo.sha("v1")
        assert first.json()["commit"] == main and first.json()["revision"] is None
        for revision in ("v1", "refs/pr/1"):
            r = client.post("/api/models/pulls", json={"repo_id": "org/revised", "revision": revision})
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert error["code"] == "pull_in_progress" and error["param"] == "revision", error
            assert f"revision {revision!r} is commit {repo.sha(revision)[:12]}" in error["message"], error
            assert (
                f"pull {first.json()['id']} of the same repo is fetching commit {main[:12]}"
                in error["message"]
            )
        for revision in ("main", main):
            r = client.post("/api/models/pulls", json={"repo_id": "org/revised", "revision": revision})
            assert r.status_code == 200 and r.json()["id"] == first.json()["id"], r.text
        assert client.post(f"/api/transfers/{first.json()['id']}/cancel").json()["status"] == "cancelled"
        r = client.post("/api/models/pulls", json={"repo_id": "org/revised", "revision": "v1"})
        assert r.status_code == 201, r.text
        assert (
            r.json()["commit"] == v1 and r.json()["revision"] == "v1" and r.json()["id"] != first.json()["id"]
        )


def test_the_cli_pull_names_the_endpoint_setting_when_the_hub_cannot_be_reached(
    tmp_path: Path, hub: FakeHub
) -> None:
    settings = settings_for(tmp_path, hub, hub_endpoint=f"http://127.0.0.1:{free_port()}")
    done = subprocess.run(
        roundhouse("models", "pull", "org/tiny"),
        env=child_env(**settings.child_environment()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"org/tiny: the Hub at {settings.hub_endpoint} cannot be reached"), (
        done.stderr
    )
    assert "ROUNDHOUSE_HUB_ENDPOINT" in done.stderr and "Connection refused" in done.stderr, done.stderr


def progress_events(client: TestClient, transfer_id: str) -> list[dict[str, Any]]:
    events = []
    with client.stream("GET", f"/api/transfers/{transfer_id}/stream") as r:
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: ") and kind == "progress":
                events.append(json.loads(line[6:]))
            elif line.startswith("data: ") and kind == "end":
                break
    return events


@pytest.mark.slow
def test_a_pulled_sharded_model_trains_on_a_real_worker(tmp_path: Path, hub: FakeHub) -> None:
    settings = settings_for(tmp_path, hub)
    with api(settings) as client:
        worker = WorkerProcess(settings, tmp_path / "worker.log").start()
        try:
            pull = client.post("/api/models/pulls", json={"repo_id": "org/tiny"}).json()
            events = progress_events(client, pull["id"])
            done = [e["bytes_done"] for e in events]
            assert events[-1]["status"] == "succeeded", (events[-1], worker.tail())
            assert done == sorted(done) and done[-1] == pull["bytes_total"] == events[-1]["bytes_total"]
            folder = settings.models_dir / "org" / "tiny"
            sizes = {f["path"]: f["size"] for f in pull["files"]}
            assert {
                p.name: p.stat().st_size
                for p in folder.iterdir()
                if p.is_file() and p.name != ".hub-source.json"
            } == sizes
            listed = {m["name"]: m for m in client.get("/api/models").json()["data"]}["org/tiny"]
            assert (
                listed["source"] == "hub" and listed["supported"] and listed["hub"]["repo_id"] == "org/tiny"
            )
            assert not (hub.served["org/tiny/pytorch_model.bin"] or hub.served["org/tiny/model.gguf"])
            job = start_job(client, dataset(client), base_model="org/tiny")
            wait_for_job(client, job["id"], {"succeeded"}, timeout=TIMEOUT_S, logs=[worker])
        finally:
            worker.end()


@pytest.mark.slow
def test_cancel_mid_download_and_a_killed_worker_resumes(tmp_path: Path, hub: FakeHub) -> None:
    settings = settings_for(tmp_path, hub)
    hub.add_folder("org/slow", _repo_folder(hub, "org/tiny", tmp_path))
    hub.bytes_per_s = 150_000
    try:
        with api(settings) as client:
            worker = WorkerProcess(settings, tmp_path / "worker.log").start()
            pull = client.post("/api/models/pulls", json={"repo_id": "org/slow"}).json()
            get = lambda: client.get(f"/api/transfers/{pull['id']}").json()  # noqa: E731
            wait_for(
                get, until=lambda t: t["bytes_done"] > 0.3 * t["bytes_total"], timeout=60, details=worker.tail
            )
            worker.stop(signal.SIGKILL, grace=0)
            worker.kill_group()
            at_kill = get()["bytes_done"]
            served_at_kill = weights_served(hub, "org/slow")
            worker = WorkerProcess(settings, tmp_path / "worker2.log").start()
            try:
                final = wait_for(
                    get, until={"succeeded"}, fail_on={"failed", "cancelled"}, timeout=90, details=worker.tail
                )
                weights = sum(f["size"] for f in final["files"] if f["path"].endswith(".safetensors"))
                served = weights_served(hub, "org/slow")
                assert final["attempts"] == 2 and served_at_kill > 0
                # what was on disk at the kill was not fetched again (a chunk in flight may be)
                assert served < weights + at_kill // 2 and served - weights <= 256 * 1024, (
                    served,
                    weights,
                    at_kill,
                )
                # a second pull, cancelled mid-download: nothing stays
                r = client.delete("/api/models/org/slow")
                assert r.status_code == 200 and r.json()["freed_bytes"] >= weights
                hub.bytes_per_s = 40_000
                again = client.post("/api/models/pulls", json={"repo_id": "org/slow"}).json()
                get = lambda: client.get(f"/api/transfers/{again['id']}").json()  # noqa: E731
                wait_for(
                    get,
                    until=lambda t: t["bytes_done"] > 0.2 * t["bytes_total"],
                    timeout=60,
                    details=worker.tail,
                )
                assert client.post(f"/api/transfers/{again['id']}/cancel").json()["status"] in (
                    "cancelling",
                    "cancelled",
                )
                wait_for(get, until={"cancelled"}, timeout=30, details=worker.tail)
                assert not any((settings.models_dir / ".pulls").iterdir())
                assert not (settings.models_dir / "org").exists()
                assert "org/slow" not in {m["name"] for m in client.get("/api/models").json()["data"]}
            finally:
                worker.end()
    finally:
        hub.bytes_per_s = None


def _repo_folder(hub: FakeHub, repo: str, tmp_path: Path) -> Path:
    folder = tmp_path / "slow-repo"
    for path, data in hub.repos[("model", repo)].files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(data)
    return folder


def fill_up(folder: Path) -> Path:
    """A file in ``folder`` written until its disk has no space left (real blocks); its removal
    gives the space back."""
    path = folder / "ballast"
    block = b"\0" * (1 << 16)
    with path.open("wb", buffering=0) as out:
        try:
            while True:
                out.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return path


def test_a_disk_that_fills_mid_pull_fails_it_naming_the_disk_and_leaves_nothing(
    tmp_path: Path, hub: FakeHub
) -> None:
    """The models folder is a small real disk that something else fills while a pull downloads:
    the pull fails (``disk_full``) naming the folder, the bytes it needs and the bytes free; its
    partial download is gone and no model is registered; once space is freed a pull succeeds."""
    settings = settings_for(tmp_path, hub)
    hub.add_folder("org/roomy", _repo_folder(hub, "org/tiny", tmp_path))
    hub.bytes_per_s = 20_000  # about 10 s for the weights: the disk fills well before they are whole
    try:
        with small_disk(settings.models_dir, 4 << 20) as disk, api(settings) as client:
            worker = WorkerProcess(settings, tmp_path / "worker.log").start()
            try:
                pull = client.post("/api/models/pulls", json={"repo_id": "org/roomy"}).json()
                get = lambda: client.get(f"/api/transfers/{pull['id']}").json()  # noqa: E731
                wait_for(get, until=lambda t: t["bytes_done"] > 0, timeout=60, details=worker.tail)
                ballast = fill_up(disk)  # the disk fills while the weights arrive
                failed = wait_for(
                    get, until={"failed"}, fail_on={"succeeded"}, timeout=60, details=worker.tail
                )
                assert failed["error_code"] == "disk_full", failed
                staging = settings.models_dir / ".pulls"
                error = failed["error"]
                assert f"disk full: {staging}" in error and "partial download was removed" in error, error
                needed = int(error.split(" needs ", 1)[1].split(" bytes", 1)[0])
                free = int(error.split("), ", 1)[1].split(" bytes", 1)[0])
                assert needed == failed["bytes_total"] and free < needed, error
                assert list(staging.iterdir()) == [] and not (disk / "org").exists()
                assert "org/roomy" not in {m["name"] for m in client.get("/api/models").json()["data"]}
                ballast.unlink()
                again = client.post("/api/models/pulls", json={"repo_id": "org/roomy"}).json()
                get = lambda: client.get(f"/api/transfers/{again['id']}").json()  # noqa: E731
                wait_for(
                    get, until={"succeeded"}, fail_on={"failed", "cancelled"}, timeout=60, details=worker.tail
                )
                assert "org/roomy" in {m["name"] for m in client.get("/api/models").json()["data"]}
            finally:
                worker.end()
    finally:
        hub.bytes_per_s = None
