"""Several GPU hosts that share nothing but the database, the broker and the object store.

Real processes: PostgreSQL (the machine's), Redis, moto's S3 server, the API (``roundhouse
serve``) and two ``roundhouse worker`` processes, each with its own empty ROUNDHOUSE_HOME and its
own ROUNDHOUSE_WORKER_HOST. Where the machine allows it (root), each worker is a separate test host
(``tests.utils.hosts``): its own network namespace that reaches the main host's services only over
a bridge, its own host name, and the API's and the other worker's folders hidden under empty
mounts, so the base model, the dataset and the checkpoint it resumes from can only have come
through the store. Jobs pinned to each host run there; a worker SIGKILLed mid-job loses its job to
the other host, which resumes from the stored checkpoint to the weights of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.server.conftest import _redis_url, postgres_database
from tests.server.test_worker import ROWS, unpack
from tests.utils import Process, child_env, free_port, roundhouse
from tests.utils.hosts import Host, Lan, lan, namespaces_unavailable
from tests.utils.jobs import start_job, wait_for_job
from tests.utils.s3 import S3Server, moto_server

pytestmark = pytest.mark.slow

HOSTS = ("host-a", "host-b")
TIMEOUT_S = 150
# a job killed once it reached step 5 runs this long: long enough that it cannot end first
KILL_STEPS = 120
LEASE_S = 3.0
# what a test host may see of the main host: run in each host's namespaces (argv: the services'
# port on 127.0.0.1, then the folders it must not see)
PROBE = """
import os, socket, sys
port, *hidden = sys.argv[1:]
for folder in hidden:
    assert os.listdir(folder) == [], f"{folder} is visible"
try:
    socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
except OSError:
    pass
else:
    raise AssertionError(f"127.0.0.1:{port} of the main host answers")
print(socket.gethostname())
"""


def environment(settings: Settings) -> dict[str, str]:
    """The ``ROUNDHOUSE_*`` variables of ``settings`` for a child process (and nothing else of ours)."""
    env = child_env(
        **settings.child_environment(),
        ROUNDHOUSE_QUEUE=settings.queue,
        ROUNDHOUSE_LEASE_SECONDS=str(settings.lease_seconds),
        ROUNDHOUSE_TELEMETRY_SECONDS=str(settings.telemetry_seconds),
        ROUNDHOUSE_REQUEUE_AFTER_SECONDS=str(settings.requeue_after_seconds),
    )
    if settings.redis_url:
        env["ROUNDHOUSE_REDIS_URL"] = settings.redis_url
    if settings.worker_host:
        env["ROUNDHOUSE_WORKER_HOST"] = settings.worker_host
    env["ROUNDHOUSE_RENDEZVOUS_PORT"] = str(settings.rendezvous_port)
    env["ROUNDHOUSE_BOX_TIMEOUT_SECONDS"] = str(settings.box_timeout_seconds)
    return env


@dataclass
class Worker:
    host: Host
    settings: Settings
    process: Process

    @property
    def home(self) -> Path:
        return self.settings.home

    @property
    def process_name(self) -> str:
        """The worker id its claims carry (``roundhouse worker``'s default name)."""
        return f"roundhouse-{self.process.pid}@{self.host.name}"


@dataclass
class Cluster:
    api: httpx.Client
    s3: Any  # a boto3 S3 client
    bucket: str
    prefix: str
    api_settings: Settings
    workers: list[Worker]
    isolated: bool

    def logs(self) -> str:
        return "\n".join(f"--- {w.host.name}\n{w.process.tail()}" for w in self.workers)

    def objects(self, key: str) -> dict[str, bytes]:
        """The store's objects under the folder ``key`` (relative to the store's prefix), by relative name."""
        folder = f"{self.prefix}/{key}/"
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder)
        names = [o["Key"] for page in pages for o in page.get("Contents", [])]
        return {n[len(folder) :]: self.s3.get_object(Bucket=self.bucket, Key=n)["Body"].read() for n in names}

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.api.get(f"/api/jobs/{job_id}").json())

    def wait(self, job_id: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        return wait_for_job(self.api, job_id, done, timeout=TIMEOUT_S, logs=self.logs)

    def events(self, job_id: str) -> list[dict[str, Any]]:
        r = self.api.get(f"/api/jobs/{job_id}/events", params={"limit": 1000})
        return list(r.json()["data"])

    def claims(self, job_id: str) -> list[tuple[str, str]]:
        """(from, worker) of each state event into running."""
        return [
            (e["data"]["from"], e["data"]["worker"])
            for e in self.events(job_id)
            if e["kind"] == "state" and e["data"]["to"] == "running"
        ]

    def start_job(self, dataset_id: str, *, steps: int, every: int, host: str | None = None) -> str:
        placement = {} if host is None else {"placement": {"host": host}}
        hyper, checkpoint = {"max_steps": steps}, {"every_steps": every}
        return str(start_job(self.api, dataset_id, hyper=hyper, checkpoint=checkpoint, **placement)["id"])

    def download(self, job_id: str, step: int, into: Path) -> dict[str, str]:
        """The checkpoint's adapter through the API, unpacked into ``into``; checks that every file
        but the README is byte for byte the store's object. Returns its manifest."""
        r = self.api.get(f"/api/jobs/{job_id}/checkpoints/{step}/download", follow_redirects=True)
        assert r.status_code == 200, r.text
        manifest = unpack(r.content, into)
        stored = self.objects(f"runs/{job_id}/checkpoints/step_{step:06d}")
        assert {n for n in stored if not n.startswith("state/")} == set(manifest) - {"MANIFEST.sha256"}
        for name, digest in manifest.items():
            if name != "README.md":  # the download's own: what it is and how to load it
                assert hashlib.sha256(stored[name]).hexdigest() == digest, name
        return manifest


@contextlib.contextmanager
def started(process: Process) -> Iterator[Process]:
    try:
        yield process.start()
    finally:
        process.stop(grace=20)
        process.kill_group()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with make_cluster(tmp_path, HOSTS) as made:
        yield made


@contextlib.contextmanager
def make_cluster(tmp_path: Path, hosts: tuple[str, ...], **worker_settings: Any) -> Iterator[Cluster]:
    """The API and a worker on each of ``hosts``, sharing PostgreSQL, Redis and an S3 store only
    (``worker_settings``: more of each worker's ``Settings``)."""
    redis = _redis_url()
    if redis is None:
        pytest.skip("no Redis server answers (make test starts one)")
    # ROUNDHOUSE_TEST_HOSTS=plain: workers as plain processes, even where namespaces work
    why_not = "ROUNDHOUSE_TEST_HOSTS=plain" if os.environ.get("ROUNDHOUSE_TEST_HOSTS") == "plain" else None
    why_not = why_not or namespaces_unavailable()
    homes = {name: tmp_path / name for name in ("api", *hosts)}
    for home in homes.values():
        home.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_database())  # skips without PostgreSQL
        s3: S3Server = stack.enter_context(moto_server(logs / "moto.log"))
        network: Lan = stack.enter_context(lan(isolated=why_not is None))
        store = s3.settings(prefix="roundhouse")
        common: dict[str, Any] = {
            "queue": f"t-{uuid.uuid4().hex}",
            "lease_seconds": LEASE_S,
            "telemetry_seconds": 0.5,
            "requeue_after_seconds": 2.0,
        }
        # the main host: the API on 127.0.0.1, with the base model in its own models folder
        api_settings = Settings(
            home=homes["api"], database_url=database, redis_url=redis, **store, **common, port=free_port()
        )
        tiny = tiny_model_folder(api_settings.models_dir / "tiny")
        env = environment(api_settings)
        pushed = subprocess.run(
            roundhouse("models", "push", "tiny", str(tiny)),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        made = subprocess.run(
            roundhouse("keys", "create"), env=env, capture_output=True, text=True, timeout=120
        )
        assert made.returncode == 0, made.stderr
        key = made.stdout.strip()
        serve = roundhouse("serve", "--host", "127.0.0.1", "--port", str(api_settings.port))
        api = stack.enter_context(started(Process(serve, env=env, log=logs / "api.log")))
        base = f"http://127.0.0.1:{api_settings.port}"
        api.wait_for_http(f"{base}/api/health", timeout=90)

        # the GPU hosts: the main host's services by the address they reach it at
        remote = {
            "database_url": network.url(database),
            "redis_url": network.url(redis),
            **store,
            "s3_endpoint_url": network.url(s3.endpoint_url),
        }
        workers = []
        for name in hosts:
            others = [homes["api"], *(homes[h] for h in hosts if h != name)]
            host = network.host(name, hidden=others)
            if network.isolated:  # the separation holds before anything runs there
                port = str(urlsplit(redis).port)
                probe = [sys.executable, "-c", PROBE, port, *map(str, others)]
                seen = subprocess.run(host.command(probe), capture_output=True, text=True, timeout=60)
                assert (seen.returncode, seen.stdout.strip()) == (0, name), seen.stderr
            # on one network namespace (plain processes) each first box listens on a port of its own
            own = {} if network.isolated else {"rendezvous_port": free_port()}
            settings = Settings(
                home=homes[name], worker_host=name, **remote, **common, **own, **worker_settings
            )
            command = host.command(roundhouse("worker", "--loglevel", "INFO"))
            process = Process(command, env=environment(settings), log=logs / f"{name}.log")
            workers.append(Worker(host, settings, stack.enter_context(started(process))))
        client = stack.enter_context(
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        )
        bucket, prefix = store["storage_url"].removeprefix("s3://").split("/", 1)
        if why_not is not None:
            print(f"the workers are plain processes on this machine: {why_not}")
        yield Cluster(client, s3.client(), bucket, prefix, api_settings, workers, network.isolated)


def test_jobs_run_on_both_hosts_and_a_killed_host_s_job_resumes_on_the_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    from engine.config import TrainConfig
    from engine.training.run import train
    from server.storage import open_storage
    from server.worker import files

    c = cluster
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    r = c.api.post("/api/datasets", files={"file": ("rows.jsonl", content)})
    assert r.status_code == 201, r.text
    dataset = str(r.json()["id"])

    # one job pinned to each host: both run, each on its own host
    pinned = {w.host.name: c.start_job(dataset, steps=4, every=2, host=w.host.name) for w in c.workers}
    for worker in c.workers:
        job_id = pinned[worker.host.name]
        job = c.wait(job_id, lambda j: j["status"] in ("succeeded", "failed"))
        assert job["status"] == "succeeded", (job["error"], c.logs())
        assert job["placement"] == {"host": worker.host.name, "gpus": None}
        assert c.claims(job_id) == [("queued", worker.process_name)]
        listed = c.api.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
        assert [(x["step"], x["kind"]) for x in listed] == [(2, "adapter"), (4, "adapter")]
        manifest = c.download(job_id, 4, tmp_path / f"{job_id}-step4")
        assert "adapter_model.safetensors" in manifest
    # each host has only its own run, and what it pulled from the store: the dataset and, where
    # the API's folder is hidden from it, the base model
    for worker, other in zip(c.workers, c.workers[::-1], strict=True):
        assert (worker.home / "runs" / pinned[worker.host.name] / "checkpoints" / "step_000004").is_dir()
        assert not (worker.home / "runs" / pinned[other.host.name]).exists()
        assert list((worker.home / "cache" / "datasets").iterdir()), "the dataset was not pulled"
        assert not (worker.home / "roundhouse.db").exists()
        if c.isolated:
            assert (worker.home / "cache" / "models" / "tiny" / "config.json").is_file()
    grouped = {h["hostname"]: h for h in c.api.get("/api/gpus").json()["hosts"]}
    assert all(grouped[name]["online"] for name in HOSTS), grouped

    # a job for any host: its worker is SIGKILLed after its first checkpoint was stored
    job_id = c.start_job(dataset, steps=KILL_STEPS, every=4)
    job = c.wait(job_id, lambda j: j["status"] == "running" and j["step"] >= 5)
    assert c.objects(f"runs/{job_id}/checkpoints/step_000004"), "no stored checkpoint"
    ((_, first),) = c.claims(job_id)
    (doomed,) = [w for w in c.workers if w.process_name == first]
    (survivor,) = [w for w in c.workers if w is not doomed]
    children = doomed.process.descendants()
    doomed.process.kill()  # no warm shutdown, no outcome recorded
    # its pool process notices and kills the training process: nothing more comes from that host
    _, alive = psutil.wait_procs(children, timeout=30)
    assert alive == [], f"{alive} outlived their worker"
    killed_at = c.job(job_id)["step"]
    stored = [x["step"] for x in c.api.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]]
    assert killed_at < KILL_STEPS, "the job finished before its worker was killed"
    job = c.wait(job_id, lambda j: j["status"] in ("succeeded", "failed"))
    assert job["status"] == "succeeded", (job["error"], c.logs())
    assert c.claims(job_id) == [("queued", doomed.process_name), ("interrupted", survivor.process_name)]
    states = [e["data"]["to"] for e in c.events(job_id) if e["kind"] == "state"]
    assert states == ["validating", "queued", "running", "interrupted", "running", "succeeded"]
    (resumed,) = [e for e in c.events(job_id) if e["kind"] == "resume"]
    step = resumed["data"]["step"]
    assert step == max(stored) and 4 <= step <= killed_at, (step, stored, killed_at)
    # the survivor never had that checkpoint: it pulled it from the store
    run = survivor.home / "runs" / job_id
    assert (
        f"pulled the stored checkpoint runs/{job_id}/checkpoints/step_{step:06d}"
        in (run / "train.log").read_text()
    )

    # its final adapter, downloaded through the API, is bitwise the one of the same config trained
    # without a stop (here, from the store's dataset and the API's base model)
    c.download(job_id, KILL_STEPS, tmp_path / "resumed")
    reference_home = tmp_path / "reference"
    settings = c.api_settings.model_copy(update={"home": reference_home})
    raw = files.local_config(settings, open_storage(settings), config=job["config"], base_model="tiny")
    train(TrainConfig.model_validate(raw), models_dir=c.api_settings.models_dir)
    ours = load_file(tmp_path / "resumed" / "adapter_model.safetensors")
    final = Path(raw["output_dir"]) / "checkpoints" / f"step_{KILL_STEPS:06d}"
    theirs = load_file(final / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
