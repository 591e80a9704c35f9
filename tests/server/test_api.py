"""The REST API on a real database: auth, the error shape, datasets, models, jobs."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from server.kinds import EventKind
from server.services import gpus, jobs, keys
from server.settings import Settings
from server.tables import Dataset
from tests.utils.jobs import job_body

CHAT = [
    {"messages": [{"role": "user", "content": f"How many {i}?"}, {"role": "assistant", "content": str(i)}]}
    for i in range(12)
]


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload(client: TestClient, content: bytes, filename: str = "train.jsonl", **form: str) -> Any:
    return client.post("/api/datasets", files={"file": (filename, content)}, data=form)


def stored_files(settings: Settings) -> list[Path]:
    folder = settings.datasets_dir
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def make_job(client: TestClient, dataset_id: str, **extra: Any) -> Any:
    return client.post("/api/jobs", json=job_body(dataset_id, **extra))


def every_route(routes: list[Any]) -> list[Any]:
    """The app's routes, with included routers opened up (FastAPI wraps each include)."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        out += every_route(inner.routes) if inner is not None else [route]
    return out


def test_health_is_public_and_every_other_route_needs_a_key(client: TestClient) -> None:
    anonymous = TestClient(client.app)
    assert anonymous.get("/api/health").json() | {"version": None} == {
        "status": "ok",
        "version": None,
        "authenticated": False,
    }
    assert client.get("/api/health").json()["authenticated"] is True
    # the web UI's files are public; its data comes from the API
    assert anonymous.get("/").status_code == 200 and "Roundhouse" in anonymous.get("/").text
    assert anonymous.get("/static/js/api.js").status_code == 200
    checked = 0
    for route in every_route(client.app.routes):  # type: ignore[attr-defined]
        if not isinstance(route, APIRoute) or route.path in ("/api/health", "/", "/login"):
            continue
        path = route.path.replace("{job_id}", "x").replace("{dataset_id}", "x").replace("{step}", "1")
        for method in route.methods:
            for headers in ({}, {"Authorization": "Bearer rh_not_a_key"}):
                r = anonymous.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["error"]["code"] == "unauthorized"
                checked += 1
    assert checked == 2 * 74  # 74 routes behind a key (the OpenAPI pages, their assets and schema, the guide)
    # the login page rejects a wrong token and turns a good one into a cookie
    assert anonymous.get("/login", params={"token": "rh_wrong"}).status_code == 401
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        token = keys.create_login(session, key_id=None, lifetime=timedelta(minutes=10))
    r = anonymous.get("/login", params={"token": token}, follow_redirects=False)
    assert r.status_code == 303 and "roundhouse_session" in r.headers["set-cookie"]
    assert anonymous.get("/api/jobs").status_code == 200  # the cookie now authenticates


def test_one_error_shape(client: TestClient) -> None:
    r = client.get("/api/jobs/nope")
    assert r.status_code == 404
    assert r.json() == {"error": {"code": "not_found", "message": "no job 'nope'", "param": "job_id"}}
    r = client.get("/api/jobs", params={"limit": 0})
    body = r.json()["error"]
    assert r.status_code == 422 and body["code"] == "invalid_request" and body["param"] == "limit"
    assert set(body) == {"code", "message", "param", "details"}


def test_dataset_upload_list_get_preview_delete(client: TestClient, settings: Settings) -> None:
    r = upload(client, jsonl(CHAT), name="counts")
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["name"], ds["format"], ds["rows"], ds["filename"]) == ("counts", "chat", 12, "train.jsonl")
    assert [d["id"] for d in client.get("/api/datasets").json()["data"]] == [ds["id"]]
    assert client.get(f"/api/datasets/{ds['id']}").json()["sha256"] == ds["sha256"]
    preview = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny", "limit": 2}).json()
    assert len(preview["rows"]) == 2
    first = preview["rows"][0]
    trained = "".join(t["text"] for t in first["tokens"] if t["trained"])
    untrained = "".join(t["text"] for t in first["tokens"] if not t["trained"])
    assert trained.startswith("0") and "How many 0?" in untrained
    stats = client.get(f"/api/datasets/{ds['id']}/stats", params={"model": "tiny", "max_length": 12}).json()
    assert stats["rows"] == stats["sampled"] == 12 and sum(b["count"] for b in stats["histogram"]) == 12
    longest = max(len(r["tokens"]) for r in preview["rows"])
    assert stats["max"] >= longest and stats["truncated_share"] == 1.0  # every row is longer than 12
    r = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "missing"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert client.delete(f"/api/datasets/{ds['id']}").status_code == 204
    assert client.get(f"/api/datasets/{ds['id']}").status_code == 404
    assert stored_files(settings) == []


BAD = {
    "bad json": (b'{"text": "fine"}\n{"text": \n', [2]),
    "missing field": (jsonl([{"text": "fine"}, {"other": "x"}, {"text": "ok"}]), [2]),
    "empty field": (jsonl([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}]), [2]),
    "unknown role": (jsonl([CHAT[0], {"messages": [{"role": "wizard", "content": "x"}]}]), [2]),
    "no assistant turn": (jsonl([CHAT[0], CHAT[1], {"messages": [{"role": "user", "content": "x"}]}]), [3]),
    "wrong type": (jsonl([{"text": "fine"}, {"text": 5}]), [2]),
    "undecodable bytes": (b'{"text": "fine"}\n{"text": "\xff\xfe"}\n', [2]),
}


def test_each_malformed_dataset_is_rejected_with_its_lines_and_nothing_is_stored(
    client: TestClient, settings: Settings
) -> None:
    for kind, (content, lines) in BAD.items():
        r = upload(client, content)
        assert r.status_code == 422, (kind, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_dataset" and error["param"] == "file", kind
        assert [d["line"] for d in error["details"]] == lines, (kind, error)
        assert f"line {lines[0]}" in error["message"], (kind, error["message"])
    assert client.get("/api/datasets").json()["data"] == []
    assert stored_files(settings) == []


def test_upload_limits_and_file_names(client: TestClient, settings: Settings) -> None:
    big = jsonl([{"text": "x" * 1000}] * 300)  # over the 200 kB limit of these tests
    r = upload(client, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert stored_files(settings) == []
    r = upload(client, b"a,b\n", filename="notes.txt")
    assert r.status_code == 422 and "'.txt'" in r.json()["error"]["message"]
    r = upload(client, jsonl(CHAT), filename="../../../etc/evil name.jsonl")
    assert r.status_code == 201
    assert r.json()["filename"] == "evil_name.jsonl"
    (stored,) = stored_files(settings)
    assert stored.name == "evil_name.jsonl" and settings.datasets_dir.resolve() in stored.resolve().parents


def test_models_lists_the_models_folder(client: TestClient) -> None:
    found = {m["name"]: m for m in client.get("/api/models").json()["data"]}
    tiny = found["tiny"]
    assert tiny["source"] == "models" and tiny["architecture"] == "LlamaForCausalLM" and tiny["ready"]
    assert tiny["parameters"] > 10_000 and tiny["size_bytes"] > 4 * tiny["parameters"]


def test_job_create_validates_names_fields_and_records_transitions(client: TestClient) -> None:
    ds = upload(client, jsonl(CHAT)).json()
    r = make_job(client, ds["id"], hyper={"learning_rate": -1})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["param"] == "hyper.learning_rate" and "-1" in error["message"], error
    r = make_job(client, ds["id"], engine={"num_microbatches": 9}, hyper={"batch_size": 4})
    assert r.status_code == 422 and "num_microbatches" in r.json()["error"]["message"]
    r = make_job(client, "missing")
    assert r.status_code == 404 and r.json()["error"]["param"] == "dataset_id"
    r = make_job(client, ds["id"], base_model="nonexistent")
    assert r.status_code == 404 and r.json()["error"]["param"] == "base_model"
    r = make_job(client, ds["id"], surprise=1)
    assert r.status_code == 422 and r.json()["error"]["param"] == "surprise"
    assert client.get("/api/jobs").json()["data"] == []  # nothing stored by the failures

    job = make_job(client, ds["id"], name="first").json()
    assert job["status"] == "queued" and job["config"]["hyper"]["max_steps"] == 2
    events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
    assert [(e["kind"], e["data"].get("to")) for e in events] == [
        ("state", "validating"),
        ("state", "queued"),
    ]
    assert client.post(f"/api/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    r = client.post(f"/api/jobs/{job['id']}/cancel")
    assert r.status_code == 409 and r.json()["error"]["code"] == "illegal_transition"

    # a dataset an unfinished job may read stays; one only finished jobs name goes, they stay
    queued = make_job(client, ds["id"], name="second").json()
    r = client.delete(f"/api/datasets/{ds['id']}")
    assert r.status_code == 409 and queued["id"] in r.json()["error"]["message"]
    client.post(f"/api/jobs/{queued['id']}/cancel")
    assert client.delete(f"/api/datasets/{ds['id']}").status_code == 204
    assert client.get(f"/api/datasets/{ds['id']}").status_code == 404
    assert ds["id"] not in {d["id"] for d in client.get("/api/datasets").json()["data"]}
    assert client.get(f"/api/jobs/{job['id']}").json()["dataset_id"] == ds["id"]
    r = client.post(f"/api/jobs/{job['id']}/resume")
    assert r.status_code == 409 and r.json()["error"]["param"] == "dataset_id"
    assert r.json()["error"]["code"] == "file_deleted" and "train.jsonl" in r.json()["error"]["message"]
    assert client.delete(f"/api/jobs/{job['id']}").status_code == 204
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        assert session.get(Dataset, ds["id"]) is not None  # the other job still names it
    assert client.delete(f"/api/jobs/{queued['id']}").status_code == 204
    with sessions() as session:
        assert session.get(Dataset, ds["id"]) is None


def test_job_list_pages_by_cursor_and_filters(client: TestClient) -> None:
    ds = upload(client, jsonl(CHAT)).json()
    made = [make_job(client, ds["id"], name=f"j{i}").json()["id"] for i in range(5)]
    client.post(f"/api/jobs/{made[1]}/cancel")
    seen, cursor = [], None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/api/jobs", params=params).json()
        seen += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == made[::-1]
    cancelled = client.get("/api/jobs", params={"status": "cancelled"}).json()["data"]
    assert [j["id"] for j in cancelled] == [made[1]]
    assert client.get("/api/jobs", params={"status": "bogus"}).status_code == 422
    assert client.get("/api/jobs", params={"cursor": "garbage"}).json()["error"]["param"] == "cursor"


def test_events_page_and_stream_replays_from_last_event_id(client: TestClient) -> None:
    ds = upload(client, jsonl(CHAT)).json()
    job = make_job(client, ds["id"]).json()
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        for step in range(1, 6):
            jobs.add_event(
                session, job_id=job["id"], kind="metrics", step=step, data={"loss/train": 5.0 - step}
            )
    client.post(f"/api/jobs/{job['id']}/cancel")
    every = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    ids = [e["id"] for e in every]
    assert ids == sorted(ids) and len(ids) == 2 + 5 + 1
    page = client.get(f"/api/jobs/{job['id']}/events", params={"limit": 3}).json()
    assert [e["id"] for e in page["data"]] == ids[:3] and page["next_after"] == ids[2]
    series = client.get(f"/api/jobs/{job['id']}/metrics", params={"keys": ["loss/train"]}).json()["data"]
    assert list(series) == ["loss/train"]
    assert [(p["step"], p["value"]) for p in series["loss/train"]] == [(s, 5.0 - s) for s in range(1, 6)]
    # the stream replays what follows Last-Event-ID, then ends: the job is in a final state
    with client.stream("GET", f"/api/jobs/{job['id']}/stream", headers={"Last-Event-ID": str(ids[3])}) as r:
        text = "".join(r.iter_text())
    streamed = [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]
    assert streamed == ids[4:] and "event: end" in text


def test_device_samples_are_telemetry_events_and_metric_series(client: TestClient) -> None:
    ds = upload(client, jsonl(CHAT)).json()
    job = make_job(client, ds["id"]).json()
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        gpus.record(
            session,
            worker_id="w@box",
            hostname="box",
            devices=[{"index": 0, "name": "GPU", "utilization": 40.0, "memory_used": 3e9}],
            cpu={"utilization": 5.0, "memory_used": 8e9},
            message="1 GPU(s)",
        )
        sample = gpus.job_sample(session, worker_id="w@box")
        assert sample == {
            "host/cpu_utilization": 5.0,
            "host/memory_used": 8e9,
            "gpu/0/utilization": 40.0,
            "gpu/0/memory_used": 3e9,
        }
        assert gpus.job_sample(session, worker_id="nobody") == {}
        jobs.add_event(session, job_id=job["id"], kind=EventKind.METRICS, step=1, data={"loss/train": 2.0})
        jobs.add_event(session, job_id=job["id"], kind=EventKind.TELEMETRY, data=sample)
    client.post(f"/api/jobs/{job['id']}/cancel")
    events = client.get(f"/api/jobs/{job['id']}/events").json()["data"]
    assert [(e["kind"], e["step"]) for e in events if e["kind"] != "state"] == [
        ("metrics", 1),
        ("telemetry", None),
    ]
    series = client.get(f"/api/jobs/{job['id']}/metrics").json()["data"]
    assert [(p["step"], p["value"]) for p in series["loss/train"]] == [(1, 2.0)]
    assert [(p["step"], p["value"]) for p in series["gpu/0/utilization"]] == [(None, 40.0)]
    with client.stream("GET", f"/api/jobs/{job['id']}/stream") as r:
        text = "".join(r.iter_text())
    assert "event: telemetry" in text and "event: metrics" in text


def test_migration_0002_turns_old_device_samples_into_telemetry(database_url: str) -> None:
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text

    from server.db import MIGRATIONS, make_engine, migrate

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO datasets (id, name, filename, path, format, rows, size_bytes, sha256,"
                " created_at) VALUES ('d', 'd', 'd', 'd', 'chat', 1, 1, 'x', CURRENT_TIMESTAMP)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO jobs (id, name, status, base_model, dataset_id, config, output_dir, step,"
                " attempts, created_at) VALUES ('j', 'j', 'running', 'tiny', 'd', '{}', 'out', 0, 1,"
                " CURRENT_TIMESTAMP)"
            )
        )
        for kind, step in (("metrics", 1), ("metrics", None), ("state", None), ("log", None)):
            conn.execute(
                text(
                    "INSERT INTO job_events (job_id, kind, step, message, data, created_at)"
                    " VALUES ('j', :kind, :step, '', '{}', CURRENT_TIMESTAMP)"
                ),
                {"kind": kind, "step": step},
            )
    migrate(engine)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT kind, step FROM job_events ORDER BY id")).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("metrics", 1), ("telemetry", None), ("state", None), ("log", None)]


def test_openapi_documents_the_one_error_shape(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    get_job = schema["paths"]["/api/jobs/{job_id}"]["get"]["responses"]
    assert get_job["404"]["content"] == error and get_job["401"]["content"] == error
    create = schema["paths"]["/api/jobs"]["post"]["responses"]
    assert create["422"]["content"] == error and create["404"]["content"] == error
    upload_ = schema["paths"]["/api/datasets"]["post"]["responses"]
    assert upload_["413"]["content"] == error and upload_["422"]["content"] == error
    assert set(schema["components"]["schemas"]["ErrorBody"]["properties"]) == {"error"}


def test_state_machine_claim_lease_and_sweep(client: TestClient) -> None:
    ds = upload(client, jsonl(CHAT)).json()
    job_id = make_job(client, ds["id"]).json()["id"]
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        job = session.get(jobs.Job, job_id)
        try:
            jobs.transition(session, job=job, to="succeeded")
            raise AssertionError("queued -> succeeded must be rejected")
        except jobs.IllegalTransition as exc:
            assert "queued" in str(exc) and "succeeded" in str(exc)
        assert jobs.claim(session, job_id=job_id, worker_id="w1", lease_seconds=60)
        assert not jobs.claim(session, job_id=job_id, worker_id="w2", lease_seconds=60)  # taken
        assert jobs.renew(session, job_id=job_id, worker_id="w2", lease_seconds=60) is None
        assert jobs.sweep(session) == []  # the lease is fresh
        assert jobs.renew(session, job_id=job_id, worker_id="w1", lease_seconds=-1) == "running"
        assert jobs.sweep(session) == [job_id]  # expired: interrupted, to requeue
        assert jobs.claim(session, job_id=job_id, worker_id="w2", lease_seconds=60)
        assert not jobs.finish(session, job_id=job_id, worker_id="w1", to="succeeded", message="late")
        assert jobs.finish(session, job_id=job_id, worker_id="w2", to="succeeded", message="done")
    states = [
        (e["data"].get("from"), e["data"].get("to"))
        for e in client.get(f"/api/jobs/{job_id}/events").json()["data"]
        if e["kind"] == "state"
    ]
    assert states == [
        (None, "validating"),
        ("validating", "queued"),
        ("queued", "running"),
        ("running", "interrupted"),
        ("interrupted", "running"),
        ("running", "succeeded"),
    ]
    assert client.get(f"/api/jobs/{job_id}").json()["attempts"] == 2


def test_gpus_reports_hosts_and_says_no_gpu_honestly(client: TestClient) -> None:
    assert client.get("/api/gpus").json()["data"] == []
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    with sessions() as session:
        gpus.record(
            session,
            worker_id="w@cpu-host",
            hostname="cpu-host",
            devices=[],
            cpu={"utilization": 12.0},
            message="no GPU on this host",
        )
    (host,) = client.get("/api/gpus").json()["data"]
    assert host["gpu"] is False and host["message"] == "no GPU on this host" and host["online"] is True
    assert host["sampled_at"] is not None


def test_a_job_the_broker_cannot_take_is_kept_with_its_send_pending(settings: Settings) -> None:
    from server.app import create_app

    broken = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})  # nothing listens there
    app = create_app(broken)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {app.state.first_key}"
        ds = upload(client, jsonl(CHAT)).json()
        r = make_job(client, ds["id"])
        assert r.status_code == 201 and r.json()["status"] == "queued"  # a worker's reconcile sends it
        assert [j["id"] for j in client.get("/api/jobs").json()["data"]] == [r.json()["id"]]
        events = client.get(f"/api/jobs/{r.json()['id']}/events").json()["data"]
        assert events[-1]["kind"] == "log" and events[-1]["data"] == {"send_pending": True}


def test_plan_reads_the_workers_gpus_and_calibrates_from_a_job(client: TestClient) -> None:
    body = {
        "base_model": "demo",
        "data": {"max_length": 1024},
        "hyper": {"batch_size": 8, "max_steps": 100},
        "engine": {"num_microbatches": 8},
    }
    assumed = client.post("/api/plan", json=body).json()
    assert assumed["fits"] and assumed["assumptions"]["detected"] == [] and assumed["stages"]
    assert assumed["eta_s"] == assumed["iteration_s"] * 100
    sessions = client.app.state.sessions  # type: ignore[attr-defined]
    device = {"name": "GPU", "utilization": 0.0, "memory_used": 0, "temperature": 30.0, "power_w": 20.0}
    with sessions() as session:
        gpus.record(
            session,
            worker_id="w@box",
            hostname="box",
            devices=[device | {"index": i, "memory_total": 24 * 10**9} for i in range(4)],
            cpu={"utilization": 1.0, "memory_total": 64e9, "cores": 16.0},
            message="4 GPU(s)",
        )
    detected = client.post("/api/plan", json=body).json()
    assert detected["assumptions"]["detected"] == ["GPU count", "GPU memory", "host RAM"]
    assert detected["gpu_memory_gb"] == 24.0
    # a job measured at half the predicted rate halves the assumed efficiency
    ds = upload(client, jsonl(CHAT)).json()
    job = make_job(client, ds["id"], base_model="tiny").json()
    past = job_body()  # the job's own body
    predicted = client.post("/api/plan", json=past).json()["tokens_per_s"]
    with sessions() as session:
        for step in (1, 2, 3):
            jobs.add_event(
                session,
                job_id=job["id"],
                kind="metrics",
                step=step,
                data={"throughput/tokens_per_s": predicted / 2},
            )
    calibrated = client.post("/api/plan", json=body | {"calibrate_job_id": job["id"]}).json()
    assert calibrated["calibrated_from"] == job["id"]
    assert abs(calibrated["assumptions"]["efficiency"] - detected["assumptions"]["efficiency"] / 2) < 1e-3
    r = client.post("/api/plan", json=body | {"hyper": {"batch_size": 4, "max_steps": 100}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "engine.num_microbatches"
    assert client.post("/api/plan", json=body | {"base_model": "nope"}).status_code == 404


def test_plan_takes_the_job_create_body_and_plans_its_train_config(client: TestClient) -> None:
    from engine.config import TrainConfig
    from engine.model.loading import demo_config
    from engine.planner import Hardware, Workload, plan_job

    ds = upload(client, jsonl(CHAT)).json()  # 12 rows
    sections = {
        "data": {"max_length": 512},
        "method": {"kind": "lora", "lora_r": 8, "target_modules": ["q_proj", "v_proj"]},
        "hyper": {"epochs": 2, "batch_size": 4},
        "engine": {"num_microbatches": 2, "async_optimizer": True, "compute_dtype": "auto"},
    }
    body = {"base_model": "demo", "dataset_id": ds["id"], **sections}
    planned = client.post("/api/plan", json=body)
    assert planned.status_code == 200, planned.text
    config = TrainConfig.parse(sections | {"data": {"train": "unused.jsonl", "max_length": 512}})
    workload = Workload.from_train_config(config, num_sequences=12)
    assert workload.steps == 6  # 2 epochs of 12 rows // 4 per batch
    expected = plan_job(demo_config(), Hardware(), workload).to_dict() | {"calibrated_from": None}
    assert planned.json() == expected
    # without the dataset there is no row count: no step count, no ETA
    assert client.post("/api/plan", json=body | {"dataset_id": None}).json()["eta_s"] is None
    r = client.post("/api/plan", json=body | {"dataset_id": "nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "dataset_id"


def test_plan_names_the_bad_field_of_a_section(client: TestClient) -> None:
    for section, param in (
        ({"hyper": {"learning_rate": -1}}, "hyper.learning_rate"),
        ({"method": {"kind": "qlora"}}, "method.kind"),
        ({"engine": {"compute_dtype": "int3"}}, "engine.compute_dtype"),
        ({"data": {"max_length": "long"}}, "data.max_length"),
        ({"config": {"num_hidden_layers": 2}}, "config.hidden_size"),
        ({"seq_len": 2048}, "seq_len"),  # the old flat body: not a field any more
    ):
        r = client.post("/api/plan", json={"base_model": "demo"} | section)
        error = r.json()["error"]
        assert r.status_code == 422 and error["param"] == param, (section, error)


def test_plan_answers_the_body_the_new_job_page_sends(client: TestClient) -> None:
    ds = upload(client, jsonl(CHAT)).json()
    # what web/js/pages/new-job.js builds, unchanged, for both POST /api/plan and POST /api/jobs
    body = {
        "base_model": "tiny",
        "dataset_id": ds["id"],
        "data": {"max_length": 1024, "validation_fraction": 0.1},
        "method": {"kind": "lora", "lora_r": 16},
        "hyper": {
            "batch_size": 4,
            "learning_rate": 0.0003,
            "schedule": "cosine",
            "warmup_steps": 0,
            "max_steps": 2,
        },
        "engine": {
            "devices": "auto",
            "num_microbatches": 2,
            "async_optimizer": False,
            "compute_dtype": "auto",
        },
        "checkpoint": {"every_steps": 20},
        "eval": {"every_steps": 1},
        "name": "from the form",
    }
    planned = client.post("/api/plan", json=body)
    assert planned.status_code == 200 and planned.json()["fits"], planned.text
    assert planned.json()["eta_s"] == planned.json()["iteration_s"] * 2
    assert client.post("/api/jobs", json=body).status_code == 201


def test_models_lists_the_hugging_face_cache(settings: Settings, tmp_path: Path) -> None:
    from server.services import models
    from tests.engine.tiny import tiny_model_folder

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-chat" / "snapshots" / "0123abcd"
    tiny_model_folder(snapshot)
    (cache / "models--acme--half-downloaded" / "snapshots" / "feed").mkdir(parents=True)  # no config.json
    found = {m.name: m for m in models.discover(settings.models_dir, cache)}
    assert "acme/half-downloaded" not in found
    cached = found["acme/tiny-chat"]
    assert cached.source == "hf-cache" and cached.path == snapshot and cached.ready
    assert cached.architecture == "LlamaForCausalLM" and cached.parameters and cached.parameters > 10_000
