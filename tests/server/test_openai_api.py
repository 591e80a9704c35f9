"""``/v1``: OpenAI's fine-tuning API, driven by the official ``openai`` client against a live server
(uvicorn on a port): files, jobs (create, list with paging and metadata, cancel, pause, resume,
events), errors in OpenAI's shape, and a run by a real worker whose fine-tuned model and
checkpoints the playground and /v1/chat/completions run and the download route serves by name."""

from __future__ import annotations

import contextlib
import csv
import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from server.app import create_app
from server.services import fine_tuned, openai_compat
from server.settings import Settings
from tests.engine.tiny import tiny_model_folder
from tests.server.conftest import WorkerProcess, _redis_url, postgres_database
from tests.utils import free_port
from tests.utils.jobs import wait_for

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Count to {i % 7}."},
            {"role": "assistant", "content": str(i % 7)},
        ]
    }
    for i in range(48)
]
CHAT = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
PREFERENCE = "".join(
    json.dumps(
        {
            "input": {"messages": [{"role": "user", "content": f"Count to {i}."}]},
            "preferred_output": [{"role": "assistant", "content": str(i)}],
            "non_preferred_output": [{"role": "assistant", "content": "no"}],
        }
    )
    + "\n"
    for i in range(8)
).encode()
# a few CPU steps of the tiny model (our extension: what OpenAI's request cannot say)
SMALL = {
    "data": {"max_length": 64},
    "method": {"lora_r": 4},
    "hyper": {"max_steps": 4, "learning_rate": 0.01, "optimizer": "sgd"},
    "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2, "compute_dtype": "float32"},
    "checkpoint": {"every_steps": 2, "keep_last": 10},
}
TIMEOUT_S = 180


class LiveServer:
    """The app on a real port (uvicorn in a thread), and an ``openai`` client for its ``/v1``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.key = str(self.app.state.first_key)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, timeout=60)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120)


def _settings(root: Path, *, redis: str | None = None, database_url: str | None = None) -> Settings:
    home = root / "home"
    tiny_model_folder(home / "models" / "tiny")
    return Settings(
        home=home,
        database_url=database_url or f"sqlite:///{root / 'roundhouse.db'}",
        redis_url=redis,
        queue=f"t-{uuid.uuid4().hex}",
        max_upload_bytes=200_000,
        lease_seconds=3.0,
        telemetry_seconds=0.5,
        cancel_grace_seconds=60.0,
    )


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def idle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server no worker serves: its jobs stay queued (a folder broker, nothing reads it);
    on SQLite and on PostgreSQL (skipped without a server)."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(postgres_database()) if request.param == "postgresql" else None
        server = stack.enter_context(LiveServer(_settings(tmp_path_factory.mktemp("idle"), database_url=url)))
        yield server


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, WorkerProcess]]:
    """A live server and a real worker (Redis when one answers, else the folder broker)."""
    root = tmp_path_factory.mktemp("busy")
    settings = _settings(root, redis=_redis_url())
    with LiveServer(settings) as server:
        worker = WorkerProcess(settings, root / "worker.log").start()
        try:
            yield server, worker
        finally:
            worker.end()


def upload(client: openai.OpenAI, content: bytes = CHAT, name: str = "rows.jsonl") -> str:
    return client.files.create(file=(name, content), purpose="fine-tune").id


def test_files_upload_list_retrieve_content_delete(idle: LiveServer) -> None:
    client = idle.client()
    first = client.files.create(file=("rows.jsonl", CHAT), purpose="fine-tune")
    assert (first.object, first.purpose, first.status, first.bytes) == (
        "file",
        "fine-tune",
        "processed",
        len(CHAT),
    )
    assert (
        first.id.startswith("file-") and isinstance(first.created_at, int) and first.filename == "rows.jsonl"
    )
    second = upload(client)
    stored = {f.id for f in client.files.list()}
    assert client.files.retrieve(first.id) == first
    assert client.files.content(first.id).read() == CHAT
    page = client.files.list(limit=1)
    assert [f.id for f in page.data] == [second] and page.has_more
    assert [f.id for f in client.files.list(limit=1, after=second).data] == [first.id]
    assert {first.id, second} <= {f.id for f in client.files.list(limit=1)}  # the client pages on
    assert [f.id for f in client.files.list(purpose="batch")] == []

    with pytest.raises(openai.BadRequestError) as bad:  # an invalid row: nothing stored
        client.files.create(file=("bad.jsonl", CHAT + b'{"messages": "nope"}\n'), purpose="fine-tune")
    assert (bad.value.param, bad.value.type, bad.value.code) == (
        "file",
        "invalid_request_error",
        "invalid_dataset",
    )
    assert "line 49" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("rows.jsonl", CHAT), purpose="assistants")
    assert bad.value.param == "purpose"
    assert {f.id for f in client.files.list()} == stored

    deleted = client.files.delete(second)
    assert (deleted.id, deleted.object, deleted.deleted) == (second, "file", True)
    with pytest.raises(openai.NotFoundError) as missing:
        client.files.retrieve(second)
    assert (missing.value.param, missing.value.type) == ("file_id", "not_found_error")


def test_create_maps_the_request_and_refuses_bad_files(idle: LiveServer) -> None:
    client = idle.client()
    file_id = upload(client)
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=file_id,
        validation_file=file_id,
        suffix="counter",
        seed=7,
        metadata={"team": "a", "run": "1"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}},
        extra_body={"roundhouse": {"method": {"lora_r": 4, "lora_alpha": 8}}},
    )
    assert job.id.startswith("ftjob-") and job.object == "fine_tuning.job" and job.status == "queued"
    assert (job.model, job.training_file, job.validation_file, job.seed) == ("tiny", file_id, file_id, 7)
    assert job.metadata == {"team": "a", "run": "1"} and job.fine_tuned_model is None and job.error is None
    assert job.hyperparameters.model_dump() == {
        "n_epochs": 2,
        "batch_size": 4,
        "learning_rate_multiplier": 1.0,
    }
    assert job.method is not None and job.method.type == "supervised" and job.method.supervised is not None
    assert isinstance(job.created_at, int) and job.organization_id == "roundhouse" and job.result_files == []
    ours = idle.http().get(f"/api/jobs/{job.to_dict()['roundhouse']['job_id']}").json()
    assert ours["name"].startswith("counter: tiny on rows.jsonl") and ours["config"]["method"]["lora_r"] == 4
    assert {"epochs": 2, "batch_size": 4, "learning_rate": 2e-4, "seed": 7}.items() <= ours["config"][
        "hyper"
    ].items()
    assert client.fine_tuning.jobs.retrieve(job.id) == job

    auto = client.fine_tuning.jobs.create(model="tiny", training_file=file_id)  # every "auto"
    shown = auto.hyperparameters.model_dump()
    assert (
        shown == {"n_epochs": 1, "batch_size": 8, "learning_rate_multiplier": 1.0} and auto.metadata is None
    )

    for body, param in [
        ({"training_file": "file-nope"}, "training_file"),
        ({"validation_file": "file-nope"}, "validation_file"),
        ({"model": "no-such-model"}, "model"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"suffix": "a:b"}, "suffix"),
        ({"method": {"type": "reinforcement"}}, "method.reinforcement.grader"),
    ]:
        with pytest.raises(openai.BadRequestError) as bad:
            client.fine_tuning.jobs.create(**({"model": "tiny", "training_file": file_id} | body))  # type: ignore[arg-type]
        assert (bad.value.param, bad.value.type) == (param, "invalid_request_error"), bad.value.body
    with pytest.raises(openai.BadRequestError) as bad:  # our extension's field, named as such
        client.fine_tuning.jobs.create(
            model="tiny", training_file=file_id, extra_body={"roundhouse": {"hyper": {"warmup_steps": -1}}}
        )
    assert bad.value.param == "roundhouse.hyper.warmup_steps"
    # OpenAI's own batch_size below our default micro-batch count: the service fits the count to it
    small = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=file_id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 2}}},
    )
    config = idle.http().get(f"/api/jobs/{small.to_dict()['roundhouse']['job_id']}").json()["config"]
    assert config["hyper"]["batch_size"] == 2 and config["engine"]["num_microbatches"] == 2
    # a micro-batch count the caller set that does not fit is refused naming that field
    with pytest.raises(openai.BadRequestError) as bad:
        client.fine_tuning.jobs.create(
            model="tiny",
            training_file=file_id,
            hyperparameters={"batch_size": 2},
            extra_body={"roundhouse": {"engine": {"num_microbatches": 4}}},
        )
    assert bad.value.param == "roundhouse.engine.num_microbatches"


def test_dpo_jobs_take_preference_files(idle: LiveServer) -> None:
    client = idle.client()
    pairs = upload(client, PREFERENCE, "pairs.jsonl")
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=pairs,
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.25, "learning_rate_multiplier": 0.5}}},
    )
    assert job.status == "queued" and job.method is not None and job.method.type == "dpo"
    assert job.method.dpo is not None and job.method.dpo.hyperparameters is not None
    assert job.method.dpo.hyperparameters.beta == 0.25
    config = idle.http().get(f"/api/jobs/{job.to_dict()['roundhouse']['job_id']}").json()["config"]
    assert (config["method"]["objective"], config["method"]["beta"], config["hyper"]["learning_rate"]) == (
        "dpo",
        0.25,
        1e-4,
    )
    with pytest.raises(openai.BadRequestError) as bad:  # a chat file is no preference data
        client.fine_tuning.jobs.create(model="tiny", training_file=upload(client), method={"type": "dpo"})
    assert bad.value.param == "training_file"


def test_reinforcement_jobs_take_prompt_files_and_a_grader(idle: LiveServer) -> None:
    client = idle.client()
    rows = [{"prompt": f"Count to {i}.", "reference_answer": str(i)} for i in range(8)]
    prompts = upload(client, "".join(json.dumps(r) + "\n" for r in rows).encode(), "prompts.jsonl")
    assert client.files.retrieve(prompts).to_dict()["roundhouse"]["format"] == "prompts"
    grader = {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
        "operation": "eq",
    }
    job = client.fine_tuning.jobs.create(
        model="tiny",
        training_file=prompts,
        method={
            "type": "reinforcement",
            "reinforcement": {"grader": grader, "hyperparameters": {"batch_size": 4, "eval_interval": 2}},  # type: ignore[typeddict-item]
        },
        extra_body={"roundhouse": {"method": {"group_size": 2, "max_completion_tokens": 8}}},
    )
    assert job.status == "queued" and job.method is not None and job.method.type == "reinforcement"
    assert job.method.reinforcement is not None and job.method.reinforcement.grader.to_dict() == grader
    config = idle.http().get(f"/api/jobs/{job.to_dict()['roundhouse']['job_id']}").json()["config"]
    assert (config["method"]["objective"], config["method"]["group_size"], config["eval"]["every_steps"]) == (
        "grpo",
        2,
        2,
    )
    assert client.fine_tuning.jobs.retrieve(job.id).method == job.method
    bad = {"type": "reinforcement", "reinforcement": {"grader": grader | {"operation": "equals"}}}
    with pytest.raises(openai.BadRequestError) as refused:  # the grader's field, as the request named it
        client.fine_tuning.jobs.create(model="tiny", training_file=prompts, method=bad)  # type: ignore[arg-type]
    assert refused.value.param == "method.reinforcement.grader.operation", refused.value.body
    with pytest.raises(openai.BadRequestError) as refused:  # a chat file holds no prompts to sample for
        client.fine_tuning.jobs.create(
            model="tiny",
            training_file=upload(client),
            method={"type": "reinforcement", "reinforcement": {"grader": grader}},  # type: ignore[typeddict-item]
        )
    assert refused.value.param == "training_file" and "not a prompts dataset" in str(refused.value)


def test_list_pages_by_after_and_filters_by_metadata(idle: LiveServer) -> None:
    client = idle.client()
    file_id, tag = upload(client), uuid.uuid4().hex
    made = [
        client.fine_tuning.jobs.create(
            model="tiny", training_file=file_id, metadata={"batch": tag, "i": str(i)}
        ).id
        for i in range(5)
    ]
    newest_first = made[::-1]
    page = client.fine_tuning.jobs.list(limit=2, metadata={"batch": tag})
    assert page.object == "list" and [j.id for j in page.data] == newest_first[:2] and page.has_more  # type: ignore[attr-defined]
    nxt = client.fine_tuning.jobs.list(limit=2, after=page.data[-1].id, metadata={"batch": tag})
    assert [j.id for j in nxt.data] == newest_first[2:4] and nxt.has_more
    auto = client.fine_tuning.jobs.list(limit=2, metadata={"batch": tag})
    assert [j.id for j in auto] == newest_first  # auto-pagination follows has_more and the last id
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"batch": tag, "i": "3"})] == [made[3]]
    every = [j.id for j in client.fine_tuning.jobs.list(limit=100)]
    assert every[: len(made)] == newest_first and not client.fine_tuning.jobs.list(limit=100).has_more
    without = client.fine_tuning.jobs.list(extra_query={"metadata": "null"}, limit=100)
    assert not set(made) & {j.id for j in without.data}
    with pytest.raises(openai.BadRequestError) as bad:
        client.fine_tuning.jobs.list(after="ftjob-nope")
    assert bad.value.param == "after"


def test_cancel_pause_resume_events_and_errors(idle: LiveServer) -> None:
    client = idle.client()
    job = client.fine_tuning.jobs.create(model="tiny", training_file=upload(client))
    assert client.fine_tuning.jobs.pause(job.id).status == "paused"  # queued: paused at once
    assert client.fine_tuning.jobs.resume(job.id).status == "queued"
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and isinstance(cancelled.finished_at, int)
    with pytest.raises(openai.ConflictError) as conflict:
        client.fine_tuning.jobs.cancel(job.id)
    assert conflict.value.param == "fine_tuning_job_id" and conflict.value.type == "invalid_request_error"

    found = list(client.fine_tuning.jobs.list_events(job.id, limit=2))  # newest first, paged by 2
    assert [e.object for e in found] == ["fine_tuning.job.event"] * len(found)
    assert [e.message for e in found][-2:] == ["config and data valid", "created"]
    assert found[0].data["to"] == "cancelled" and found[0].level == "info" and found[0].type == "message"  # type: ignore[index]
    ids = [int(e.id.removeprefix("ftevent-")) for e in found]
    assert ids == sorted(ids, reverse=True) and len(found) == 5  # created, queued, paused, queued, cancelled
    page = client.fine_tuning.jobs.list_events(job.id, limit=2, after=found[1].id)
    assert [e.id for e in page.data] == [e.id for e in found[2:4]] and page.has_more
    assert list(client.fine_tuning.jobs.checkpoints.list(job.id)) == []

    with pytest.raises(openai.NotFoundError) as missing:
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    assert (missing.value.param, missing.value.type) == ("fine_tuning_job_id", "not_found_error")
    with pytest.raises(openai.AuthenticationError) as denied:
        idle.client("rh_not_a_key").fine_tuning.jobs.list()
    assert denied.value.type == "authentication_error" and denied.value.code == "unauthorized"
    r = httpx.get(f"{idle.url}/v1/files")  # no key at all; /api keeps its own error shape
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert set(httpx.get(f"{idle.url}/api/jobs").json()["error"]) == {"code", "message", "param"}


def wait_status(client: openai.OpenAI, job_id: str, statuses: set[str], worker: WorkerProcess) -> Any:
    return wait_for(
        lambda: client.fine_tuning.jobs.retrieve(job_id),
        until=statuses,
        fail_on={"failed"},
        timeout=TIMEOUT_S,
        interval=0.3,
        what=job_id,
        details=worker.tail,
    )


def test_a_run_gives_checkpoints_the_playground_and_download_take_by_name(
    busy: tuple[LiveServer, WorkerProcess],
) -> None:
    server, worker = busy
    client, http = server.client(), server.http()
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=upload(client), suffix="count", extra_body={"roundhouse": SMALL}
    )
    job = wait_status(client, job.id, {"succeeded"}, worker)
    ident = job.to_dict()["roundhouse"]["job_id"]
    assert job.fine_tuned_model == f"ft:tiny:count:{ident}" and isinstance(job.finished_at, int)

    saved = list(client.fine_tuning.jobs.checkpoints.list(job.id, limit=1))  # paged one by one
    assert [c.step_number for c in saved] == [4, 2] and saved[0].fine_tuning_job_id == job.id
    assert [c.fine_tuned_model_checkpoint for c in saved] == [
        f"{job.fine_tuned_model}:ckpt-step-{s}" for s in (4, 2)
    ]
    assert saved[0].metrics.step == 4 and saved[0].metrics.train_loss is not None

    metrics = [e for e in client.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
    losses = [e for e in metrics if "train_loss" in e.data]  # type: ignore[operator]
    assert [e.data["step"] for e in losses] == [4, 3, 2, 1]  # type: ignore[index]
    assert {e.data["step"] for e in metrics} == {1, 2, 3, 4}  # type: ignore[index]
    assert losses[0].message.startswith("Step 4/4: training loss=")

    assert job.fine_tuned_model in {m.id for m in client.models.list()}
    assert client.models.retrieve(saved[1].fine_tuned_model_checkpoint).owned_by == "roundhouse"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(f"{job.fine_tuned_model}:ckpt-step-3")

    # the download route by name: the same archive as /api's for that checkpoint
    by_name = http.get(f"/v1/models/{saved[1].fine_tuned_model_checkpoint}/content")
    assert by_name.status_code == 200 and by_name.headers["content-type"] == "application/x-tar"
    assert by_name.content == http.get(f"/api/jobs/{ident}/checkpoints/2/download").content
    latest = http.get(f"/v1/models/{job.fine_tuned_model}/content")
    assert latest.content == http.get(f"/api/jobs/{ident}/checkpoints/4/download").content

    # the playground by name: the job's latest checkpoint, and one checkpoint
    chat = [{"role": "user", "content": "Count to 3."}]
    for name in (job.fine_tuned_model, saved[1].fine_tuned_model_checkpoint):
        r = http.post(
            "/api/generate", json={"model": name, "messages": chat, "temperature": 0, "max_tokens": 4}
        )
        assert r.status_code == 200, r.text
        assert "event: done" in r.text and "event: error" not in r.text, r.text
    missing = http.post(
        "/api/generate", json={"model": f"ft:tiny:count:{ident}:ckpt-step-3", "messages": chat}
    )
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"

    # the fine-tuned model answers on the same base URL, by the names the job gave
    for name in (job.fine_tuned_model, saved[1].fine_tuned_model_checkpoint):
        answer = client.chat.completions.create(model=name, messages=chat, temperature=0, max_tokens=4)  # type: ignore[arg-type]
        assert answer.model == name and answer.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError) as gone:
        client.chat.completions.create(model=f"ft:tiny:count:{ident}:ckpt-step-3", messages=chat)  # type: ignore[arg-type]
    assert gone.value.code == "model_not_found"


@pytest.mark.slow
def test_a_finished_job_counts_its_tokens_gives_its_metrics_and_outlives_its_files(
    busy: tuple[LiveServer, WorkerProcess],
) -> None:
    server, worker = busy
    client, http = server.client(), server.http()
    train, valid = upload(client), upload(client, name="valid.jsonl")
    options = SMALL | {"eval": {"every_steps": 2}}
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=train, validation_file=valid, extra_body={"roundhouse": options}
    )
    assert job.result_files == [] and job.trained_tokens is None and job.estimated_finish is None
    # a second job on the same files, cancelled while it waits for the worker (or at its next step)
    other = client.fine_tuning.jobs.create(
        model="tiny", training_file=train, extra_body={"roundhouse": SMALL}
    )
    with pytest.raises(openai.ConflictError) as in_use:  # unfinished jobs use the file
        client.files.delete(train)
    assert in_use.value.param == "file_id" and "has not finished" in in_use.value.message
    client.fine_tuning.jobs.cancel(other.id)
    job = wait_status(client, job.id, {"succeeded"}, worker)
    ident = job.to_dict()["roundhouse"]["job_id"]
    keys = ["tokens/batch", "loss/train", "accuracy/train", "loss/val", "accuracy/val"]
    stored = http.get(f"/api/jobs/{ident}/metrics", params={"keys": keys}).json()["data"]
    by_step = {k: {p["step"]: p["value"] for p in stored[k]} for k in keys}
    # every token of the 4 steps' batches (prompts too, padding not): the file's tokens per epoch
    assert job.trained_tokens == sum(by_step["tokens/batch"].values()) > 0
    assert job.estimated_finish is None  # it is no longer running

    [result] = job.result_files
    text = client.files.content(result).text
    rows = list(csv.DictReader(text.splitlines()))
    assert text.splitlines()[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    names = ("train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")
    for column, key in zip(names, keys[1:], strict=True):  # as stored; validation at steps 2 and 4
        shown = {int(r["step"]): float(r[column]) for r in rows if r[column]}
        assert shown == by_step[key], column
    assert set(by_step["accuracy/val"]) == {2, 4}
    assert all(0 <= v <= 1 for v in by_step["accuracy/train"].values())
    info = client.files.retrieve(result)
    assert (info.purpose, info.filename, info.bytes) == ("fine-tune-results", "step_metrics.csv", len(text))
    with pytest.raises(openai.ConflictError) as kept:  # it goes with its job
        client.files.delete(result)
    assert kept.value.param == "file_id"
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-results-nope")

    # its files can go once every job that uses them finished; the jobs keep their record
    wait_status(client, other.id, {"cancelled"}, worker)
    assert client.files.delete(train).deleted and client.files.delete(valid).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(train)
    assert train not in {f.id for f in client.files.list()}
    again = client.fine_tuning.jobs.retrieve(job.id)
    assert (again.status, again.training_file, again.trained_tokens) == (
        "succeeded",
        train,
        job.trained_tokens,
    )
    assert job.id in {j.id for j in client.fine_tuning.jobs.list(limit=100)}
    assert client.files.content(result).text == text
    with pytest.raises(openai.ConflictError) as gone:
        client.fine_tuning.jobs.resume(other.id)
    assert (gone.value.param, gone.value.code) == ("training_file", "file_deleted")
    assert train in gone.value.message and "rows.jsonl" in gone.value.message
    with pytest.raises(openai.BadRequestError) as refused:  # a new job cannot name it
        client.fine_tuning.jobs.create(model="tiny", training_file=train)
    assert refused.value.param == "training_file"


@pytest.mark.slow
def test_a_running_job_pauses_at_a_checkpoint_and_resumes(busy: tuple[LiveServer, WorkerProcess]) -> None:
    server, worker = busy
    client = server.client()
    options = SMALL | {"hyper": SMALL["hyper"] | {"max_steps": 40}, "checkpoint": {"every_steps": 100}}
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=upload(client), extra_body={"roundhouse": options}
    )
    wait_for(  # it trains
        lambda: client.fine_tuning.jobs.retrieve(job.id).to_dict()["roundhouse"]["step"] >= 1,
        timeout=TIMEOUT_S,
        interval=0.1,
        what=f"{job.id} reaching step 1",
        details=worker.tail,
    )
    running = client.fine_tuning.jobs.retrieve(job.id)  # when its run expects to end; no tokens yet
    assert running.status == "running" and running.trained_tokens is None
    assert isinstance(running.estimated_finish, int) and running.estimated_finish >= running.created_at
    assert client.fine_tuning.jobs.pause(job.id).status == "running"  # pausing: it stops at its next step
    paused = wait_status(client, job.id, {"paused", "succeeded"}, worker)
    assert paused.status == "paused", "the run ended before the pause took effect"
    steps = [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
    assert steps and steps[0] < 40  # a checkpoint at the step it reached
    assert client.fine_tuning.jobs.resume(job.id).status == "queued"
    done = wait_status(client, job.id, {"succeeded"}, worker)
    assert client.fine_tuning.jobs.checkpoints.list(job.id).data[0].step_number == 40
    assert done.fine_tuned_model is not None
    # each of the 40 steps counted once, though the steps after the checkpoint ran twice
    ident = done.to_dict()["roundhouse"]["job_id"]
    series = server.http().get(f"/api/jobs/{ident}/metrics", params={"keys": ["tokens/batch"]}).json()
    per_step = {p["step"]: p["value"] for p in series["data"]["tokens/batch"]}
    assert sorted(per_step) == list(range(1, 41)) and done.trained_tokens == sum(per_step.values())


def test_progress_counts_each_step_once_when_a_resume_trains_steps_again(client: Any) -> None:
    from fastapi.testclient import TestClient

    from server.kinds import EventKind
    from server.services import jobs, openai_results, progress
    from tests.utils.jobs import job_body

    assert isinstance(client, TestClient)
    ds = client.post("/api/datasets", files={"file": ("rows.jsonl", CHAT)}).json()
    job_id = client.post("/api/jobs", json=job_body(ds["id"])).json()["id"]

    def log(step: int, tokens: int, loss: float) -> None:  # as the worker's sink logs a step
        metrics = {"progress/step": step, "progress/total_steps": 3, "tokens/batch": tokens, "time/eta_s": 60}
        with client.app.state.sessions() as session:  # type: ignore[attr-defined]
            jobs.add_event(
                session, job_id=job_id, kind=EventKind.METRICS, step=step, data=metrics, commit=False
            )
            progress.record(session, job_id=job_id, metrics=metrics)
            jobs.add_event(
                session, job_id=job_id, kind=EventKind.METRICS, step=step, data={"loss/train": loss}
            )

    def trained() -> int | None:
        with client.app.state.sessions() as session:  # type: ignore[attr-defined]
            return jobs.get_job(session, job_id=job_id).trained_tokens  # type: ignore[union-attr]

    for step, tokens in ((1, 10), (2, 20), (3, 30)):
        log(step, tokens, 1.0 / step)
    assert trained() == 60
    log(2, 21, 0.25)  # resumed from the checkpoint at step 1: steps 2 and 3 again
    assert trained() == 31
    log(3, 31, 0.125)
    assert trained() == 62
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        job = jobs.get_job(session, job_id=job_id)
        assert job is not None and job.estimated_finish is not None
        text = openai_results.content(session, job=job).decode()
    assert text.splitlines()[1:] == ["1,1.0,,,", "2,0.25,,,", "3,0.125,,,"]  # each step's latest


def test_auto_resolves_to_the_stated_defaults() -> None:
    sections = openai_compat.train_sections(method_type="supervised", hyperparameters={}, seed=3, options={})
    assert sections["hyper"] == {"epochs": 1, "batch_size": 8, "learning_rate": 2e-4, "seed": 3}
    full = openai_compat.train_sections(
        method_type="supervised",
        hyperparameters={"learning_rate_multiplier": 2.0, "n_epochs": "auto"},
        seed=None,
        options={"method": {"kind": "full"}, "hyper": {"epochs": 3}},
    )
    assert full["hyper"]["learning_rate"] == 4e-5 and full["hyper"]["epochs"] == 3 and "seed" in full["hyper"]
    dpo = openai_compat.train_sections(
        method_type="dpo", hyperparameters={"beta": "auto"}, seed=0, options={}
    )
    assert dpo["method"] == {"objective": "dpo", "beta": 0.1}
    assert fine_tuned.parse_model("ft:Org/Model-1:x:abc:ckpt-step-12") == ("abc", 12)
    assert fine_tuned.parse_model("ft:tiny:roundhouse:abc") == ("abc", None)
    assert fine_tuned.parse_model("tiny") is None and fine_tuned.parse_model("ft:a:b") is None


def test_migration_0011_adds_job_progress_and_deleted_datasets_as_declared(database_url: str) -> None:
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from server.db import MIGRATIONS, make_engine
    from server.tables import Base

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    for step, target in ((command.upgrade, "0011"), (command.downgrade, "0010"), (command.upgrade, "head")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            found = inspect(conn)
            columns = {c["name"] for t in ("jobs", "datasets") for c in found.get_columns(t)}
            added = {"trained_tokens", "estimated_finish", "deleted_at"}
            assert added & columns == (set() if target == "0010" else added), target
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [d for d in diff if any(f"'{t}'" in repr(d) for t in ("jobs", "datasets"))] == []


def test_migration_0006_adds_the_metadata_and_suffix_columns_as_declared(database_url: str) -> None:
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from server.db import MIGRATIONS, make_engine
    from server.tables import Base

    engine = make_engine(database_url)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    added = {"metadata", "suffix"}
    for step, target in ((command.upgrade, "0006"), (command.downgrade, "0005"), (command.upgrade, "0006")):
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            step(cfg, target)
            columns = {c["name"] for c in inspect(conn).get_columns("jobs")}
            assert added & columns == (added if target == "0006" else set()), target
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert [d for d in diff if "'jobs'" in repr(d) or "jobs." in repr(d)] == []
