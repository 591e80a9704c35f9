"""Jobs for the service and browser tests: the request body they post, posting it, and one way to
wait for a condition (a job's status, an evaluation, anything polled) that fails fast and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

import httpx

T = TypeVar("T")

# A LoRA job of the tiny base model that a CPU worker trains in seconds: two CPU stages, fp32, SGD.
JOB_BODY: dict[str, Any] = {
    "base_model": "tiny",
    "data": {"max_length": 64},
    "method": {"kind": "lora", "lora_r": 4},
    "hyper": {"max_steps": 2, "batch_size": 4, "learning_rate": 0.01, "optimizer": "sgd"},
    "engine": {"devices": ["cpu", "cpu"], "num_microbatches": 2, "compute_dtype": "float32"},
    "checkpoint": {"every_steps": 2, "keep_last": 10},
}
# how long a tiny job may take on a busy two-core machine
JOB_TIMEOUT_S = 180.0
# a job's statuses from which it moves no more
FINAL = frozenset({"succeeded", "failed", "cancelled"})


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides``: nested mappings merge key by key, other values replace."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def job_body(dataset_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The job request body the tests post, for ``dataset_id``; ``overrides`` merge into it
    (``hyper={"max_steps": 6}`` keeps the other hyper-parameters)."""
    body = merged(JOB_BODY, overrides)
    if dataset_id is not None:
        body["dataset_id"] = dataset_id
    return body


def start_job(client: httpx.Client, dataset_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """POST ``job_body(dataset_id, **overrides)`` to /api/jobs; the created job (checked: 201)."""
    r = client.post("/api/jobs", json=job_body(dataset_id, **overrides))
    assert r.status_code == 201, r.text
    return dict(r.json())


def get_job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job as GET /api/jobs/{id} shows it."""
    return dict(client.get(f"/api/jobs/{job_id}").json())


def states(client: httpx.Client, job_id: str) -> list[str]:
    """The statuses the job went through, from its state events."""
    events = client.get(f"/api/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return [e["data"]["to"] for e in events if e["kind"] == "state"]


def tails(processes: Iterable[Any]) -> str:
    """The ends of the logs of ``processes`` (anything with ``tail()``), for a failure message."""
    return "\n".join(p.tail() for p in processes)


def status_of(value: Any) -> Any:
    """The ``status`` of a job-like value: a mapping's key or an object's attribute."""
    return value["status"] if isinstance(value, Mapping) else getattr(value, "status", None)


def _test(condition: Callable[[Any], object] | Collection[str]) -> Callable[[Any], object]:
    if callable(condition):
        return condition
    statuses = frozenset([condition] if isinstance(condition, str) else condition)
    return lambda value: status_of(value) in statuses


def wait_for(
    poll: Callable[[], T],
    *,
    timeout: float,
    until: Callable[[T], object] | Collection[str] = bool,
    fail_on: Callable[[T], object] | Collection[str] = (),
    interval: float = 0.2,
    what: str = "",
    details: Callable[[], str] | None = None,
) -> T:
    """Call ``poll`` every ``interval`` s until ``until`` holds for its value, and return that value.

    ``until`` and ``fail_on`` are predicates on the value, or sets of statuses (a job's, an
    evaluation's: ``{"succeeded"}``); ``until`` is tested first, so a status in both ends the wait.

    Raises:
        AssertionError: ``fail_on`` held, or ``timeout`` s passed; with the last value, ``what``
            was awaited and ``details()`` (a worker's or server's log).
    """
    done, failed = _test(until), _test(fail_on)
    awaited = what or "the awaited condition"
    if not callable(until):
        awaited += f" (waiting for {' or '.join(sorted([until] if isinstance(until, str) else until))})"
    deadline = time.monotonic() + timeout
    while True:
        value = poll()
        if done(value):
            return value
        if failed(value):
            status = status_of(value)
            went = f"went {status}" if status is not None else "failed"
            message = f"{awaited}: {went}; last seen: {value!r}"
            break
        if time.monotonic() > deadline:
            message = f"{awaited}: not within {timeout:g} s; last seen: {value!r}"
            break
        time.sleep(interval)
    raise AssertionError(f"{message}\n{details()}" if details is not None else message)


def wait_for_job(
    client: httpx.Client,
    job_id: str,
    until: Callable[[dict[str, Any]], object] | Collection[str],
    *,
    timeout: float = JOB_TIMEOUT_S,
    fail_on: Callable[[dict[str, Any]], object] | Collection[str] = ("failed",),
    logs: Iterable[Any] | Callable[[], str] = (),
) -> dict[str, Any]:
    """``wait_for`` on GET /api/jobs/{id}: the job once ``until`` holds; a job that went
    ``failed`` first (unless ``until`` accepts it) fails the wait at once. ``logs``: processes
    whose log tails (read when the wait fails) go into the message, or a function that gives them."""
    return wait_for(
        lambda: get_job(client, job_id),
        until=until,
        fail_on=fail_on,
        timeout=timeout,
        what=f"job {job_id}",
        details=logs if callable(logs) else lambda: tails(logs),
    )
