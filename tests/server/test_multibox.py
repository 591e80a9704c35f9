"""Jobs on several boxes through the service: real worker processes as hosts "host-a", "host-b"
and "host-c" (``test_multihost.make_cluster``: their own homes and names, and where the machine
allows it their own network namespaces), sharing only PostgreSQL, Redis and the S3 store.

A job asking for 3 hosts and one asking for 2 run on that many at once, each to its end with one
set of checkpoints (written by rank 0 alone), one metrics row per step and one ``boxes`` event;
the 2-box run's final weights are those of one box trained on the whole batch. A pause stops both
boxes at one step, with its checkpoint. A box whose worker
is killed mid-job stops the run within a bounded time: the job is interrupted with an event naming
that host and resumes from its stored checkpoint on the one host left (``min_hosts`` 1), to the end.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.server.test_multihost import Cluster, make_cluster
from tests.server.test_worker import ROWS
from tests.utils.jobs import start_job

pytestmark = pytest.mark.slow

HOSTS = ("host-a", "host-b", "host-c")
BOX_TIMEOUT_S = 8.0  # a box waiting this long for another is lost
LONG = 30  # steps of the jobs paused or whose box is killed: more than they train before it


def submit(c: Cluster, dataset: str, *, steps: int, batch: int, **where: Any) -> str:
    body = {"hyper": {"max_steps": steps, "batch_size": batch}, "checkpoint": {"every_steps": 2}}
    return str(start_job(c.api, dataset, placement=where, **body)["id"])


def state_events(c: Cluster, job_id: str) -> list[dict[str, Any]]:
    return [e for e in c.events(job_id) if e["kind"] == "state"]


def boxes_of(c: Cluster, job_id: str) -> list[list[str]]:
    """The hosts of each run of the job, by rank (its reservations' state events)."""
    return [[b["host"] for b in e["data"]["boxes"]] for e in state_events(c, job_id) if "boxes" in e["data"]]


def metric_steps(c: Cluster, job_id: str) -> Counter[int]:
    return Counter(
        e["step"] for e in c.events(job_id) if e["kind"] == "metrics" and "loss/train" in e["data"]
    )


def check_one_writer(c: Cluster, job_id: str, *, hosts: list[str], steps: int) -> None:
    """One run on ``hosts``: every step's metrics and every checkpoint written once, by rank 0."""
    assert boxes_of(c, job_id) == [hosts]
    assert metric_steps(c, job_id) == Counter(range(1, steps + 1))
    listed = c.api.get(f"/api/jobs/{job_id}/checkpoints").json()["data"]
    assert [x["step"] for x in listed] == list(range(2, steps + 1, 2))
    (boxes,) = [e for e in c.events(job_id) if e["kind"] == "boxes"]
    assert boxes["data"]["hosts"] == hosts
    # the other boxes' events are log lines naming their host; no other box wrote a checkpoint
    for e in c.events(job_id):
        if "rank" in e["data"] and "event" in e["data"]:
            assert e["kind"] == "log" and e["data"]["host"] in hosts[1:], e
    for worker in c.workers:
        if worker.host.name in hosts[1:]:
            assert not list((worker.home / "runs" / job_id).glob("checkpoints/step_*")), worker.host.name


def test_jobs_on_two_and_three_boxes_and_a_lost_box_resumed_on_one(tmp_path: Path) -> None:
    from engine.config import TrainConfig
    from engine.training.run import train
    from server.storage import open_storage
    from server.worker import files

    with make_cluster(tmp_path, HOSTS, box_timeout_seconds=BOX_TIMEOUT_S) as c:
        content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        r = c.api.post("/api/datasets", files={"file": ("rows.jsonl", content)})
        assert r.status_code == 201, r.text
        dataset = str(r.json()["id"])
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # every worker registered where the others reach it
            hosts = c.api.get("/api/gpus").json()["hosts"]
            if sum(h["online"] and bool(h["workers"][0]["address"]) for h in hosts) == len(HOSTS):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the workers did not register: {hosts}\n{c.logs()}")

        # three boxes, then two: each run to its end, written once
        three = submit(c, dataset, steps=2, batch=6, hosts=3)
        job = c.wait(three, lambda j: j["status"] in ("succeeded", "failed"))
        assert job["status"] == "succeeded", (job["error"], c.logs())
        check_one_writer(c, three, hosts=list(HOSTS), steps=2)
        measured = {
            h["hostname"]: h["workers"][0]["link_measured_gbps"]
            for h in c.api.get("/api/gpus").json()["hosts"]
        }
        assert all(rate is not None and rate > 0 for rate in measured.values()), measured
        print(f"3 boxes, measured link (Gb/s): {measured}; isolated hosts: {c.isolated}")

        two = submit(c, dataset, steps=4, batch=4, hosts=2)
        job = c.wait(two, lambda j: j["status"] in ("succeeded", "failed"))
        assert job["status"] == "succeeded", (job["error"], c.logs())
        check_one_writer(c, two, hosts=["host-a", "host-b"], steps=4)
        assert [e["data"]["to"] for e in state_events(c, two)] == [
            "validating",
            "queued",
            "running",
            "succeeded",
        ]
        # the same weights as one box trained on the whole batch
        c.download(two, 4, tmp_path / "two")
        settings = c.api_settings.model_copy(update={"home": tmp_path / "reference"})
        raw = files.local_config(settings, open_storage(settings), config=job["config"], base_model="tiny")
        train(TrainConfig.model_validate(raw), models_dir=c.api_settings.models_dir)
        ours = load_file(tmp_path / "two" / "adapter_model.safetensors")
        theirs = load_file(
            Path(raw["output_dir"]) / "checkpoints" / "step_000004" / "adapter_model.safetensors"
        )
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6)

        # a pause stops both boxes at one step boundary, rank 0 writing the checkpoint of that step,
        # and frees the hosts (the next job gets them)
        paused = submit(c, dataset, steps=LONG, batch=4, hosts=2)
        c.wait(paused, lambda j: j["status"] == "running" and j["step"] >= 3)
        r = c.api.post(f"/api/jobs/{paused}/pause")
        assert r.status_code == 200, r.text
        job = c.wait(paused, lambda j: j["status"] in ("paused", "failed", "succeeded"))
        assert job["status"] == "paused", (job["error"], c.logs())
        listed = [x["step"] for x in c.api.get(f"/api/jobs/{paused}/checkpoints").json()["data"]]
        assert listed[-1] == job["step"] < LONG and listed == sorted(set(listed)), (listed, job["step"])
        assert max(metric_steps(c, paused)) == job["step"]

        # host-c leaves; a job on 2 hosts (1 at the fewest) loses host-b's worker mid-run
        _, b, gone = c.workers
        assert gone.process.stop(grace=30)
        lost = submit(c, dataset, steps=LONG, batch=4, hosts=2, min_hosts=1)
        c.wait(lost, lambda j: j["status"] == "running" and j["step"] >= 3)
        assert boxes_of(c, lost) == [["host-a", "host-b"]]
        children = b.process.descendants()
        b.process.kill()
        killed = time.time()
        _, alive = psutil.wait_procs(children, timeout=30)
        assert alive == [], f"{alive} outlived their worker"
        job = c.wait(lost, lambda j: j["status"] != "running" or j["attempts"] > 1)
        states = state_events(c, lost)
        (interrupted,) = [e for e in states if e["data"]["to"] == "interrupted"]
        assert interrupted["data"]["box_lost"] == "host-b", interrupted
        assert "box host-b (rank 1) lost" in interrupted["message"], interrupted
        took = datetime.fromisoformat(interrupted["created_at"]).timestamp() - killed
        assert took < BOX_TIMEOUT_S + 30, f"the job paused {took:.0f} s after the box was lost"
        print(f"interrupted {took:.1f} s after host-b's worker was killed: {interrupted['message']}")
        job = c.wait(lost, lambda j: j["status"] in ("succeeded", "failed"))
        assert job["status"] == "succeeded", (job["error"], c.logs())
        assert boxes_of(c, lost) == [["host-a", "host-b"], ["host-a"]]
        assert [e["data"]["to"] for e in state_events(c, lost)] == [
            "validating",
            "queued",
            "running",
            "interrupted",
            "running",
            "succeeded",
        ]
        (resumed,) = [e for e in c.events(lost) if e["kind"] == "resume"]
        step = resumed["data"]["step"]
        assert step == interrupted["data"]["checkpoint_step"] and step >= 2, (resumed, interrupted)
        # each checkpoint once; each step's metrics once, but those the lost run trained past its
        # last checkpoint, trained again from it
        listed = [x["step"] for x in c.api.get(f"/api/jobs/{lost}/checkpoints").json()["data"]]
        assert listed == sorted(set(listed)) and listed[-1] == LONG, listed
        counts = metric_steps(c, lost)
        assert set(counts) == set(range(1, LONG + 1))
        assert {s for s, n in counts.items() if n > 1} <= set(range(step + 1, step + 1 + 20)), counts
