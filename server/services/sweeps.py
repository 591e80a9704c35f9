"""Sweeps: a job body searched over a few named hyperparameters (a grid, or random draws), priced
as a whole (each trial end to end: ``plans.plan``'s ``total_s``, from this box's measured times
where it ran the model before, else the planner's), its trials queued as ordinary jobs that name
the sweep; early stopping of a trial clearly worse than the others at the same step; cancel; the
trials' table."""

from __future__ import annotations

import copy
import itertools
import math
import random
import statistics
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.methods import METHODS
from server.kinds import EventKind, JobStatus
from server.schemas import JobCreate, PlanRequest, SweepCreate
from server.services import jobs, plans, submission
from server.services.failures import Invalid, NotFound, Refusal
from server.services.job_states import TERMINAL, IllegalTransition
from server.settings import Settings
from server.storage import Storage
from server.tables import Job, Sweep, now

# the fields a sweep searches, and the short names it takes for them
FIELDS: dict[str, type] = {
    "hyper.learning_rate": float,
    "method.lora_r": int,
    "method.lora_alpha": float,
    "method.lora_dropout": float,
    "hyper.epochs": float,
    "hyper.max_steps": int,
    "hyper.batch_size": int,
    "hyper.warmup_steps": int,
    "hyper.weight_decay": float,
    "method.beta": float,
}
ALIASES = {name.split(".", 1)[1]: name for name in FIELDS} | {"lora_rank": "method.lora_r"}
MAX_TRIALS = 64
# what the engine logs at every step, besides the method's metrics (engine.parallel.optimizer and
# activity): a sweep may rank trials by these too (throughput/tokens_per_s over batch sizes)
ENGINE_METRICS = ("throughput/tokens_per_s", "time/step_s", "optim/grad_norm", "pipeline/bubble_ratio")
EARLY_STOP = "early_stopped"  # the data key of the event that stops a trial


def field_of(name: str) -> str:
    """The dotted field a parameter name stands for.

    Raises:
        Invalid: not a field a sweep searches (naming it and the ones it does).
    """
    full = ALIASES.get(name, name)
    if full not in FIELDS:
        known = ", ".join(sorted(FIELDS))
        raise Invalid(
            "invalid_request", f"parameters.{name}: a sweep searches {known}", param=f"parameters.{name}"
        )
    return full


def _value(name: str, value: Any, *, drawn: bool = False) -> Any:
    """A value of the field ``name`` stands for: a whole number for an integer field (a random
    draw rounded; a value given must be one), else a float.

    Raises:
        Invalid: not a finite number, or not a whole one for an integer field (naming both).
    """
    full = field_of(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Invalid(
            "invalid_request", f"parameters.{name}: {value!r} is not a number", param=f"parameters.{name}"
        )
    if FIELDS[full] is not int:
        return float(value)
    if not drawn and value != int(value):
        message = f"parameters.{name}: {value!r} is not a whole number ({full} is an integer)"
        raise Invalid("invalid_request", message, param=f"parameters.{name}")
    return round(value)


def trial_params(request: SweepCreate) -> list[dict[str, Any]]:
    """Each trial's values, by the names the request gave: every combination of a grid (in the
    order given, cut to ``trials``), or ``trials`` random draws (``seed``): a value of a list, or
    in ``[min, max]`` (log-uniform with ``log``).

    Raises:
        Invalid: an unknown field, a value that is not a number (or not a whole one for an integer
            field), no value, an interval whose min is above its max, or too many trials.
    """
    if not request.parameters:
        raise Invalid("invalid_request", "parameters: name at least one field to search", param="parameters")
    names = list(request.parameters)
    for name in names:
        field_of(name)
    out: list[dict[str, Any]] = []
    if request.search == "grid":
        axes = []
        for name in names:
            given = request.parameters[name]
            if not isinstance(given, list) or not given:
                message = f"parameters.{name}: a grid takes a list of values"
                raise Invalid("invalid_request", message, param=f"parameters.{name}")
            axes.append([_value(name, v) for v in given])
        combos = list(itertools.product(*axes))
        if request.trials is None and len(combos) > MAX_TRIALS:
            message = (
                f"parameters: the grid has {len(combos)} combinations; at most {MAX_TRIALS} (or set trials)"
            )
            raise Invalid("invalid_request", message, param="parameters")
        out = [dict(zip(names, combo, strict=True)) for combo in combos[: request.trials]]
    else:
        if request.trials is None:
            raise Invalid(
                "invalid_request", "trials: a random search needs a number of trials", param="trials"
            )
        spaces: dict[str, list[Any] | tuple[float, float, bool]] = {}
        for name in names:  # every value checked before the first draw
            given = request.parameters[name]
            if isinstance(given, list):
                if not given:
                    raise Invalid(
                        "invalid_request", f"parameters.{name}: no values", param=f"parameters.{name}"
                    )
                spaces[name] = [_value(name, v) for v in given]
            else:
                low, high = _value(name, given.min), _value(name, given.max)
                if low > high:
                    message = f"parameters.{name}: min {given.min!r} is above max {given.max!r}"
                    raise Invalid("invalid_request", message, param=f"parameters.{name}")
                spaces[name] = (low, high, given.log)
        rng = random.Random(request.seed)
        for _ in range(request.trials):
            one = {}
            for name, space in spaces.items():
                if isinstance(space, list):
                    one[name] = rng.choice(space)
                    continue
                low, high, log = space
                drawn = (
                    math.exp(rng.uniform(math.log(low), math.log(high))) if log else rng.uniform(low, high)
                )
                one[name] = _value(name, drawn, drawn=True)
            out.append(one)
    return out


def trial_body(job: JobCreate, params: dict[str, Any]) -> dict[str, Any]:
    """The job body of one trial: the sweep's job with the trial's values in their sections."""
    body = copy.deepcopy(job.model_dump(mode="json"))
    for name, value in params.items():
        section, key = field_of(name).split(".", 1)
        body[section] = {**(body.get(section) or {}), key: value}
    return body


def describe(params: dict[str, Any]) -> str:
    return " ".join(f"{name.rsplit('.', 1)[-1]}={value:g}" for name, value in params.items())


def price(session: Session, *, request: SweepCreate, settings: Settings, storage: Storage) -> dict[str, Any]:
    """Every trial priced end to end and the whole sweep, one trial after another: ``{"eta_s":
    total or None, "fits": all fit, "estimate", "calibrated_from", "trials": [{"params", "fits",
    "eta_s", "steps_s", "overhead_s", "problems"}]}``. A trial's ``eta_s`` is its plan's
    ``total_s`` (its steps, ``steps_s``, plus what it costs besides them, ``overhead_s``: the
    trainer's start, the model's load, the data's preparation, warm-up, validation, checkpoints);
    ``estimate`` says whether this box's measured times (``"measured"``, ``"calibrated"``: the
    rate only) priced them, or the planner's assumptions (``"planner"``).

    Raises:
        Invalid, NotFound: a bad parameter or job body (the field named: ``job.<field>``, or
            ``parameters.<name>`` for a value the trials set), or a ``metric`` no trial logs.
    """
    rows: list[dict[str, Any]] = []
    sources: list[tuple[str, str | None]] = []
    objective = "sft"
    for params in trial_params(request):
        body = trial_body(request.job, params)
        keep = set(PlanRequest.model_fields) & set(body)
        try:
            plan = plans.plan(
                session,
                request=PlanRequest.model_validate({k: body[k] for k in keep}),
                settings=settings,
                storage=storage,
            )
        except Refusal as exc:
            raise _named(exc, params) from exc
        objective = plan["assumptions"]["objective"]
        sources.append((plan["estimate"], plan["calibrated_from"]))
        rows.append(
            {
                "params": params,
                "fits": bool(plan["fits"]),
                "eta_s": plan.get("total_s"),
                "steps_s": plan.get("eta_s"),
                "overhead_s": (plan.get("overheads") or {}).get("total_s"),
                "problems": list(plan.get("problems") or []),
            }
        )
    check_metric(request, objective=objective)
    etas = [r["eta_s"] for r in rows]
    total = sum(float(e) for e in etas if e is not None) if None not in etas else None
    estimate, reference = min(sources, key=lambda s: ESTIMATES.index(s[0]))  # the least measured
    return {
        "eta_s": total,
        "fits": all(r["fits"] for r in rows),
        "estimate": estimate,
        "calibrated_from": reference,
        "trials": rows,
    }


# a plan's ``estimate``, from the least measured to the most
ESTIMATES = ("planner", "calibrated", "measured")


def _validation_metric(key: str) -> bool:
    """Whether a run logs ``key`` only when it validates (``loss/val``, ``dpo/val_reward_margin``)."""
    tail = key.split("/", 1)[-1]
    return tail == "val" or tail.startswith("val_")


def check_metric(request: SweepCreate, *, objective: str) -> None:
    """The sweep ranks its trials by a metric they log: ``loss/train``, ``loss/val`` and the
    method's own (``engine.methods``: its ``metric_keys``, and others in their namespaces, e.g. a
    grader's ``reward/<name>``, ``orpo/val_nll``), or the engine's (``ENGINE_METRICS``); one a run
    logs when it validates needs validation data (a ``validation_dataset_id`` or a
    ``data.validation_fraction``).

    Raises:
        Invalid: (``metric``) a metric no trial logs, naming it and the ones they log.
    """
    metric, job = request.metric, request.job
    own = [k for k in METHODS[objective].metric_keys if k not in ("loss/train", "loss/val")]
    logged = ["loss/train", "loss/val", *own, *ENGINE_METRICS]
    spaces = {k.split("/", 1)[0] for k in own} - {"loss"}
    if metric not in logged and metric.split("/", 1)[0] not in spaces:
        message = (
            f"metric: {metric!r} is not a metric a {objective} trial logs; it logs {', '.join(logged)}"
            + (f" and others under {', '.join(sorted(s + '/' for s in spaces))}" if spaces else "")
        )
        raise Invalid("invalid_request", message, param="metric")
    validates = job.validation_dataset_id is not None or job.data.validation_fraction > 0
    if _validation_metric(metric) and not validates:
        message = (
            f"metric: {metric!r} is logged only by a run that validates, and the trials have no validation "
            "data: set job.data.validation_fraction or job.validation_dataset_id, or rank by loss/train"
        )
        raise Invalid("invalid_request", message, param="metric")


def _named(exc: Refusal, params: dict[str, Any]) -> Refusal:
    """A trial's refusal naming the sweep's field: the parameter that set it, else ``job.<field>``."""
    param = exc.param
    for name in params:
        if param == field_of(name):
            exc.param = f"parameters.{name}"
            exc.message = f"parameters.{name}={params[name]!r}: {exc.message}"
            return exc
    if param:
        exc.param = f"job.{param}"
    return exc


def create(session: Session, *, request: SweepCreate, settings: Settings, storage: Storage) -> Sweep:
    """Price the sweep, then queue its trials as jobs naming it (one after another on a worker).

    Raises:
        Invalid: a bad parameter or job body, or (``does_not_fit``) trials that do not fit.
        NotFound: no such base model or dataset.
    """
    plan = price(session, request=request, settings=settings, storage=storage)
    misfits = [f"#{i + 1} ({describe(t['params'])})" for i, t in enumerate(plan["trials"]) if not t["fits"]]
    if misfits:
        first = next(t for t in plan["trials"] if not t["fits"])
        why = "; ".join(first["problems"][:2])
        message = (
            f"trials {', '.join(misfits)} do not fit the workers: {why} (POST /api/sweeps/plan prices them)"
        )
        raise Invalid("does_not_fit", message, param="parameters")
    ident = jobs.new_id()
    name = request.name or f"sweep of {request.job.base_model} {now():%H:%M}"
    sweep = Sweep(id=ident, name=name, spec=request.model_dump(mode="json"), trials=[], plan=plan)
    session.add(sweep)
    session.commit()
    trials = []
    for i, params in enumerate(t["params"] for t in plan["trials"]):
        body = trial_body(request.job, params)
        body["name"] = f"{name} #{i + 1} {describe(params)}"[:255]
        job = submission.submit(
            session, request=JobCreate.model_validate(body), settings=settings, storage=storage
        )
        job.sweep_id = ident
        trials.append({"job_id": job.id, "params": params})
        sweep.trials = list(trials)
        session.commit()
    return sweep


def get(session: Session, *, sweep_id: str) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise NotFound(f"no sweep {sweep_id!r}", param="sweep_id")
    return sweep


def list_sweeps(session: Session, *, limit: int) -> list[Sweep]:
    return list(
        session.scalars(select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc()).limit(limit))
    )


def cancel(session: Session, *, sweep: Sweep) -> None:
    """Cancel every trial not finished yet: queued ones at once, running ones at their next step."""
    sweep.cancelled_at = sweep.cancelled_at or now()
    session.commit()
    for trial in sweep.trials:
        job = session.get(Job, trial["job_id"])
        if job is None or job.status in TERMINAL or job.status == JobStatus.CANCELLING:
            continue
        try:
            jobs.request_cancel(session, job=job)
        except IllegalTransition:  # it finished (or moved) meanwhile
            session.rollback()


def _best(values: list[float], goal: str) -> float:
    return min(values) if goal == "minimize" else max(values)


def view(session: Session, *, sweep: Sweep) -> dict[str, Any]:
    """The sweep with its trials' table: parameters, the metric (its best value so far), state,
    steps and time; the best trial; its status from its trials'."""
    spec = sweep.spec
    metric, goal = spec["metric"], spec["goal"]
    rows = []
    for i, trial in enumerate(sweep.trials):
        job = session.get(Job, trial["job_id"])
        series = (
            jobs.metric_series(session, job_id=trial["job_id"], keys=[metric]).get(metric, []) if job else []
        )
        values = [p["value"] for p in series]
        stopped = _stopped_early(session, job_id=trial["job_id"]) if job else None
        started, finished = (job.started_at, job.finished_at) if job else (None, None)
        rows.append(
            {
                "index": i + 1,
                "job_id": trial["job_id"],
                "name": job.name if job else None,
                "params": trial["params"],
                "status": job.status if job else "deleted",
                "step": job.step if job else None,
                "total_steps": job.total_steps if job else None,
                "metric": _best(values, goal) if values else None,
                "last_metric": values[-1] if values else None,
                "started_at": started,
                "finished_at": finished,
                "duration_s": (finished - started).total_seconds() if started and finished else None,
                "stopped_early": stopped,
            }
        )
    scored = [r for r in rows if r["metric"] is not None and r["status"] == JobStatus.SUCCEEDED]
    best = (min if goal == "minimize" else max)(scored, key=lambda r: r["metric"]) if scored else None
    statuses = {r["status"] for r in rows}
    if not statuses <= set(TERMINAL) | {"deleted"}:
        status = "cancelling" if sweep.cancelled_at else "running"
    else:
        status = "cancelled" if sweep.cancelled_at else "finished"
    return {
        "id": sweep.id,
        "name": sweep.name,
        "status": status,
        "metric": metric,
        "goal": goal,
        "search": spec["search"],
        "parameters": spec["parameters"],
        "early_stopping": spec["early_stopping"],
        "job": spec["job"],
        "plan": sweep.plan,
        "created_at": sweep.created_at,
        "cancelled_at": sweep.cancelled_at,
        "trials": rows,
        "best_job_id": best["job_id"] if best else None,
    }


def _stopped_early(session: Session, *, job_id: str) -> dict[str, Any] | None:
    q = select(jobs.JobEvent).where(jobs.JobEvent.job_id == job_id, jobs.JobEvent.kind == EventKind.LOG)
    for event in session.scalars(q.order_by(jobs.JobEvent.id.desc()).limit(50)):
        if EARLY_STOP in (event.data or {}):
            return dict(event.data[EARLY_STOP])
    return None


def early_stop(session: Session, *, job_id: str, step: int, value: float) -> dict[str, Any] | None:
    """Whether a trial should stop: its best ``metric`` up to ``step`` is worse than the median of
    the other trials' best up to the same step (at least two others reached it; the median
    stopping rule). Returns the reason as data, or None (not a trial, no early stopping, or not
    clearly worse)."""
    job = session.get(Job, job_id)
    if job is None or job.sweep_id is None:
        return None
    sweep = session.get(Sweep, job.sweep_id)
    if sweep is None or not sweep.spec.get("early_stopping"):
        return None
    metric, goal = sweep.spec["metric"], sweep.spec["goal"]
    own = [p["value"] for p in jobs.metric_series(session, job_id=job_id, keys=[metric]).get(metric, [])]
    mine = _best([*(v for v in own), value], goal)
    others = []
    for trial in sweep.trials:
        if trial["job_id"] == job_id:
            continue
        points = jobs.metric_series(session, job_id=trial["job_id"], keys=[metric]).get(metric, [])
        reached = [p["value"] for p in points if p["step"] is not None and p["step"] <= step]
        if reached and any(p["step"] is not None and p["step"] >= step for p in points):
            others.append(_best(reached, goal))
    if len(others) < 2:
        return None
    median = statistics.median(others)
    worse = mine > median if goal == "minimize" else mine < median
    if not worse:
        return None
    return {"step": step, "metric": metric, "value": mine, "median": median, "trials": len(others)}
