"""The engine's step metrics of where time goes (optimizer phases, idle time between iterations,
waits, transfers, prefetch hits) reach GET /api/jobs/{id}/metrics through the worker's sink."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine import EngineConfig, RoundPipe
from engine.metrics import ListSink
from server.worker.trainer import DatabaseSink
from tests.engine.parallel.test_activity import NEW_KEYS
from tests.engine.tiny import tiny_batch, tiny_model
from tests.utils.jobs import start_job

KEYS = NEW_KEYS  # the metrics the engine added for the GPU bench
ROWS = [
    {"messages": [{"role": "user", "content": f"How many {i}?"}, {"role": "assistant", "content": str(i)}]}
    for i in range(8)
]


class Both:
    """A sink writing to two sinks."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for s in self.sinks:
            s.log(metrics, step)

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        for s in self.sinks:
            s.event(kind, message, data)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def test_the_engine_metrics_of_a_job_are_served_by_its_metrics_endpoint(client: TestClient) -> None:
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    dataset = client.post("/api/datasets", files={"file": ("chat.jsonl", content)}).json()
    job = start_job(client, dataset["id"])
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    logged = ListSink()
    sink = Both(DatabaseSink(sessions, job["id"]), logged)
    config = EngineConfig(devices=["cpu", "cpu"], num_microbatches=2, optimizer="sgd", lr=0.1)
    with RoundPipe(tiny_model("llama"), config, sink=sink) as rp:
        for s in range(3):
            rp.forward_backward(**tiny_batch(seed=s))
            rp.step()
        rp.synchronize()

    series = client.get(f"/api/jobs/{job['id']}/metrics", params={"keys": KEYS}).json()["data"]
    assert sorted(series) == sorted(KEYS)
    for key in KEYS:
        assert [p["step"] for p in series[key]] == [1, 2, 3], key
        assert [p["value"] for p in series[key]] == pytest.approx(logged.series(key), rel=1e-12), key
        assert all(p["value"] >= 0 for p in series[key]), key
    assert all(p["value"] > 0 for p in series["transfer/h2d_bytes"])
    every = client.get(f"/api/jobs/{job['id']}/metrics").json()["data"]
    assert set(KEYS) <= set(every)  # listed without asking too, beside the loss
    assert "loss/train" in every
