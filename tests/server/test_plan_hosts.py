"""``POST /api/plan`` of a job on several hosts (``placement.hosts``: N or "auto"): each box plans
its share of the batch, the gradient exchange is priced over the link the hosts registered
(measured, their NICs' speed, or a nominal 10 Gbit/s), and the answer is the engine planner's."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from engine import TrainConfig
from engine.planner import Hardware, Hosts, Workload, plan_job
from server.services import gpus
from server.tables import Worker
from tests.engine.test_planner import LLAMA_3_8B

BODY: dict[str, Any] = {
    "config": LLAMA_3_8B,
    "data": {"max_length": 1024},
    "method": {"kind": "lora", "lora_r": 16},
    "hyper": {"batch_size": 8, "max_steps": 10},
    "engine": {"num_microbatches": 2, "compute_dtype": "bfloat16"},
    "hardware": {"num_gpus": 2, "gpu_memory_gb": 24, "host_ram_gb": 256},
}
DEVICE = {"name": "NVIDIA GeForce RTX 4090", "memory_total": 24e9, "memory_used": 1e9}


def _engine_plan(hosts: Hosts, body: dict[str, Any] = BODY) -> Any:
    """The engine planner's plan of the same job (the run's TrainConfig, as the service builds it)."""
    raw = {k: body[k] for k in ("data", "method", "hyper", "engine")}
    raw["data"] = raw["data"] | {"train": "(not read)"}
    workload = Workload.from_train_config(TrainConfig.parse(raw))
    return plan_job(LLAMA_3_8B, Hardware(**body["hardware"]), workload, hosts=hosts)


def _register(client: TestClient, host: str, *, link_gbps: float | None, gpus_count: int = 2) -> None:
    """A GPU worker of ``host`` sampling now, reachable for a job on several hosts."""
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        gpus.record(
            session,
            worker_id=f"w@{host}",
            hostname=host,
            devices=[DEVICE | {"index": i} for i in range(gpus_count)],
            cpu={"memory_total": 256e9, "cores": 16.0},
            message=f"{gpus_count} GPU(s)",
            endpoint=gpus.Endpoint(address=f"{host}.lan", port=29400, interface="eth0", link_gbps=link_gbps),
        )


def test_a_plan_on_two_hosts_prices_the_exchange_over_a_nominal_link(client: TestClient) -> None:
    r = client.post("/api/plan", json=BODY | {"placement": {"hosts": 2}})
    assert r.status_code == 200, r.text
    plan = r.json()
    expected = _engine_plan(Hosts(2))
    assert plan["hosts"] == 2 and plan["exchange"] == expected.exchange
    ex = plan["exchange"]
    assert (ex["link_gbps"], ex["link_measured"], ex["hidden"]) == (10.0, False, False)
    assert ex["bytes_per_step"] == 4 * plan["trainable"]  # a ring of 2: each box sends its gradients once
    for key in ("step_s", "tokens_per_s", "eta_s", "total_s", "scaling", "one_box"):
        assert plan[key] == pytest.approx(getattr(expected, key), rel=1e-12), key
    assert 1 < plan["scaling"] < 2
    a = plan["assumptions"]
    assert (a["hosts_requested"], a["hosts_online"], a["link_source"], a["rows_per_host"]) == (
        2,
        0,
        "nominal",
        4,
    )
    one = client.post("/api/plan", json=BODY).json()  # one host: no exchange
    assert (one["hosts"], one["exchange"], one["scaling"]) == (1, None, None)
    assert one["step_s"] == pytest.approx(plan["one_box"]["step_s"], rel=1e-12)
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert {"hosts", "exchange", "one_box", "scaling"} <= set(schema["PlanPublic"]["properties"])
    assert set(schema["PlanExchange"]["properties"]) == set(ex)


def test_auto_takes_the_registered_hosts_and_their_link(client: TestClient) -> None:
    _register(client, "box-a", link_gbps=25.0)
    _register(client, "box-b", link_gbps=25.0)
    _register(client, "box-c", link_gbps=10.0)
    auto = client.post("/api/plan", json=BODY | {"placement": {"hosts": "auto"}})
    assert auto.status_code == 200, auto.text
    plan = auto.json()
    a = plan["assumptions"]
    # every free host (the batch of 8 gives 4 boxes 2 micro-batches each): the slowest NIC, nominal
    assert plan["hosts"] == 3 and a["hosts_planned"] == ["box-a", "box-b", "box-c"]
    assert (a["hosts_requested"], a["link_source"]) == ("auto", "nic")
    assert plan["exchange"] == _engine_plan(Hosts(3, link_gbps=10.0)).exchange
    # a batch of 4 in 2 micro-batches gives only 2 boxes work
    small = BODY | {"hyper": {"batch_size": 4, "max_steps": 10}, "placement": {"hosts": "auto"}}
    assert client.post("/api/plan", json=small).json()["hosts"] == 2
    # the rate their last job on several hosts measured, once every box has one: the slowest
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        session.execute(update(Worker).values(link_measured_gbps=21.5))
        session.execute(update(Worker).where(Worker.hostname == "box-b").values(link_measured_gbps=19.0))
        session.commit()
    measured = client.post("/api/plan", json=BODY | {"placement": {"hosts": 2}}).json()
    assert measured["assumptions"]["link_source"] == "measured"
    assert measured["exchange"] == _engine_plan(Hosts(2, link_gbps=19.0, link_measured=True)).exchange
    assert measured["exchange"]["link_measured"] and measured["exchange"]["link_gbps"] == 19.0


def test_a_batch_too_small_for_the_hosts_names_the_field(client: TestClient) -> None:
    r = client.post("/api/plan", json=BODY | {"placement": {"hosts": 5}})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "hyper.batch_size"
    assert "hyper.batch_size=8 is smaller than 5 hosts x 2 micro-batches = 10" in error["message"]
    r = client.post("/api/plan", json=BODY | {"placement": {"hosts": 65}})
    assert r.status_code == 422 and "placement.hosts" in r.json()["error"]["param"]
