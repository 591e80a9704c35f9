"""Schemathesis over the app's own OpenAPI schema, in process: every operation, with schema-valid
(positive) and schema-invalid (negative) requests carrying a valid key, against ids that exist and
ids that do not. Shared by ``tests/server/test_fuzz.py`` (a few hundred cases in ``make test``)
and ``bench/fuzz.py`` (a longer run).

The checks, on every answer: no 5xx (nor an exception out of the app); the status, the content
type, the headers and the body are ones the schema documents for the operation; a schema-invalid
request gets a 4xx. Left out: ``positive_data_acceptance``: the schema cannot say everything a
request must be (a dataset file's rows, a TrainConfig section's rules, an id that exists), so a
schema-valid request may rightly get a 404 or 422, whose shape the other checks still hold.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.python.asgi import ASGIClient
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
# An event stream stays open while its job (or the GPU hosts' stream, always) can still change:
# the client keeps what arrived within this long and closes it. Anything else must answer in time.
STREAM_CUT_S = 1.0
ANSWER_S = 30.0
# the operations whose body names a dataset or a job (filled with existing ids in one variant)
BODY_IDS = frozenset({"POST /api/jobs", "POST /api/plan"})
# the operations that change what a job is (delete it, queue it again) get a job of their own, so
# the job the other operations share stays there, cancelled (its stream ends)
OWN_JOB = ("DELETE /api/jobs/{job_id}", "POST /api/jobs/{job_id}/resume")
CHAT = b"".join(
    b'{"messages": [{"role": "user", "content": "How many %d?"}, {"role": "assistant", "content": "%d"}]}\n'
    % (i, i)
    for i in range(12)
)


@dataclass
class Outcome:
    """One operation, one generation mode, one kind of ids: what was sent and what came back."""

    operation: str
    mode: str
    ids: str  # "generated" (random, almost never a row) or "existing" (a real job's and dataset's)
    cases: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # one line per distinct failure, with a repro
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "operation": self.operation,
            "mode": self.mode,
            "ids": self.ids,
            "cases": self.cases,
            "seconds": round(self.seconds, 2),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "failures": self.failures,
            "skipped": self.skipped,
        }


def existing_rows(client: requests.Session, key: str) -> dict[str, str]:
    """A dataset in use by cancelled jobs (so their streams end), and those jobs: ids that exist,
    the job of every operation and one of its own for each of ``OWN_JOB``. The app's models
    folder has the tiny test model as ``tiny``."""
    auth = {"Authorization": f"Bearer {key}"}
    r = client.post(
        "/api/datasets", files={"file": ("train.jsonl", CHAT)}, data={"name": "fuzz"}, headers=auth
    )
    assert r.status_code == 201, r.text
    dataset = r.json()["id"]
    body = {"base_model": "tiny", "dataset_id": dataset, "hyper": {"max_steps": 2, "batch_size": 4}}
    ids = {"dataset_id": dataset}
    for name in ("job_id", *OWN_JOB):
        r = client.post("/api/jobs", json=body, headers=auth)
        assert r.status_code == 201, r.text
        ids[name] = r.json()["id"]
        assert client.post(f"/api/jobs/{ids[name]}/cancel", headers=auth).status_code == 200
    return ids


def _with_ids(ids: dict[str, str]) -> Callable[[Case], Case]:
    """A positive case whose JSON body names a base model, a dataset or a job gets one that exists
    (so a job is created, or a plan made, from the fuzzed sections and hardware)."""
    existing = {"base_model": "tiny", "dataset_id": ids["dataset_id"], "calibrate_job_id": ids["job_id"]}

    def fill(case: Case) -> Case:
        if isinstance(case.body, dict):
            case.body.update({k: v for k, v in existing.items() if k in case.body})
        return case

    return fill


def _failure_lines(exc: BaseException, case: Case) -> list[str]:
    failures = exc.exceptions if isinstance(exc, FailureGroup) else (exc,)
    repro = case.as_curl_command()
    lines = []
    for f in failures:
        title = f.title if isinstance(f, Failure) else f"{type(f).__name__}: {f}"
        message = f.message if isinstance(f, Failure) else ""
        lines.append(f"{title}: {' '.join(message.split())[:300]} | {repro[:600]}")
    return lines


def fuzz(app: Any, key: str, *, examples: int, seed_value: int | None = None) -> list[Outcome]:
    """Fuzz every operation of ``app``'s schema; ``examples`` cases per operation, mode and kind of
    ids. ``seed_value`` None: derandomized (the same cases every run); else that seed.

    The app's database gets a dataset and a job first (``existing_rows``)."""
    auth = {"Authorization": f"Bearer {key}"}
    client = ASGIClient(app)  # not entered: no lifespan of its own (the app needs none to answer)
    ids = existing_rows(client, key)
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json", headers=auth).json())
    schema.app = app
    outcomes = []
    for result in schema.get_all_operations():
        operation = result.ok()
        path_ids = {p: ids[p] for p in ("job_id", "dataset_id") if f"{{{p}}}" in operation.path}
        if operation.label in OWN_JOB:
            path_ids["job_id"] = ids[operation.label]
        stream = operation.path.endswith("/stream")
        kinds = ("generated", "existing") if path_ids or operation.label in BODY_IDS else ("generated",)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for kind in kinds:
                outcome = Outcome(operation.label, mode.value, kind)
                strategy = operation.as_strategy(
                    generation_mode=mode, path_parameters=path_ids if kind == "existing" else None
                )
                if kind == "existing" and mode is GenerationMode.POSITIVE:
                    strategy = strategy.map(_with_ids(ids))
                _run(outcome, strategy, client, auth, stream=stream, examples=examples, seed_value=seed_value)
                outcomes.append(outcome)
    return outcomes


def _run(
    outcome: Outcome,
    strategy: st.SearchStrategy[Case],
    client: ASGIClient,
    auth: dict[str, str],
    *,
    stream: bool,
    examples: int,
    seed_value: int | None,
) -> None:
    seen: set[str] = set()

    @settings(
        max_examples=examples,
        derandomize=seed_value is None,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: each failure is reported as found
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def one(case: Case) -> None:
        outcome.cases += 1
        case.headers = {**(case.headers or {}), **auth}
        try:
            response = case.call(session=client, timeout=STREAM_CUT_S if stream else ANSWER_S)
            outcome.statuses[response.status_code] += 1
            case.validate_response(response, checks=CHECKS)
        except (Failure, FailureGroup) as exc:
            lines = _failure_lines(exc, case)
        except Exception as exc:  # out of the app (a 500 it raised) or no answer in time
            outcome.statuses[500] += 1
            lines = [f"{type(exc).__name__}: {str(exc)[:300]} | {case.as_curl_command()[:600]}"]
        else:
            return
        for line in lines:
            head = line.split(" | ")[0][:120]
            if head not in seen:
                seen.add(head)
                outcome.failures.append(line)

    test = one if seed_value is None else seed(seed_value)(one)
    start = time.perf_counter()
    try:
        test()
    except Unsatisfiable:
        outcome.skipped = "nothing in the schema to make invalid"
    outcome.seconds = time.perf_counter() - start
