"""``roundhouse sweeps plan|create|list|show|cancel``: the sweeps of ``/api/sweeps`` from the
command line, on the settings' database (a worker runs the trials)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _request(path: str) -> Any:
    from pydantic import ValidationError

    from server.schemas import SweepCreate

    try:
        return SweepCreate.model_validate(json.loads(Path(path).read_text()))
    except (OSError, ValueError, ValidationError) as exc:
        raise SystemExit(f"{path}: {exc}") from None


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def print_plan(plan: dict[str, Any]) -> None:
    for i, trial in enumerate(plan["trials"], start=1):
        params = " ".join(f"{k}={_value(v)}" for k, v in trial["params"].items())
        fits = "fits" if trial["fits"] else "DOES NOT FIT: " + "; ".join(trial["problems"][:1])
        print(f"#{i:<3} {params:<40} ETA {_eta(trial['eta_s'])}  {fits}")
    source = {"measured": "measured on this box", "calibrated": "rate measured on this box"}
    priced = source.get(plan.get("estimate", "planner"), "the planner's estimate")
    print(f"{len(plan['trials'])} trials, one after another: ETA {_eta(plan['eta_s'])} end to end ({priced})")


def print_sweep(view: dict[str, Any]) -> None:
    print(f"{view['id']}  {view['name']}  {view['status']}  ({view['goal']} {view['metric']})")
    for t in view["trials"]:
        params = " ".join(f"{k}={_value(v)}" for k, v in t["params"].items())
        best = " best" if t["job_id"] == view["best_job_id"] else ""
        early = " (stopped early)" if t["stopped_early"] else ""
        steps = f"{t['step']}/{_value(t['total_steps'])}"
        print(
            f"#{t['index']:<3} {t['job_id']}  {params:<36} {t['status']:<10}{early} step {steps:<9} "
            f"{view['metric']} {_value(t['metric'])}  {_eta(t['duration_s'])}{best}"
        )


def _run(args: argparse.Namespace, action: str) -> int:
    from server.db import migrated_sessions
    from server.services import sweeps
    from server.services.failures import Refusal
    from server.settings import get_settings
    from server.storage import open_storage

    settings = get_settings()
    sessions = migrated_sessions(settings.url)
    with sessions() as session:
        try:
            if action == "plan":
                print_plan(
                    sweeps.price(
                        session,
                        request=_request(args.body),
                        settings=settings,
                        storage=open_storage(settings),
                    )
                )
                return 0
            if action == "create":
                request = _request(args.body)
                sweep = sweeps.create(
                    session, request=request, settings=settings, storage=open_storage(settings)
                )
                print_plan(sweep.plan)
            elif action == "list":
                for sweep in sweeps.list_sweeps(session, limit=args.limit):
                    view = sweeps.view(session, sweep=sweep)
                    print(f"{view['id']}  {view['status']:<10} {len(view['trials'])} trials  {view['name']}")
                return 0
            else:
                sweep = sweeps.get(session, sweep_id=args.sweep_id)
                if action == "cancel":
                    sweeps.cancel(session, sweep=sweep)
            print_sweep(sweeps.view(session, sweep=sweep))
        except Refusal as exc:
            where = f"{exc.param}: " if exc.param and not exc.message.startswith(exc.param) else ""
            print(f"{where}{exc.message}", file=sys.stderr)
            return 1
    return 0


def add_parser(sub: Any) -> None:
    """The ``sweeps`` command and its subcommands."""
    p = sub.add_parser("sweeps", help="hyperparameter sweeps: trials queued as jobs (POST /api/sweeps)")
    ps = p.add_subparsers(dest="sweeps_command", required=True)
    for name, help_text in (
        ("plan", "price a sweep (each trial's fit and ETA) without starting it"),
        ("create", "price a sweep and queue its trials"),
    ):
        c = ps.add_parser(name, help=help_text)
        c.add_argument("body", metavar="SWEEP.json", help="the body of POST /api/sweeps")
        c.set_defaults(func=lambda a, n=name: _run(a, n))
    ls = ps.add_parser("list", help="sweeps, newest first")
    ls.add_argument("--limit", type=int, default=20, help="the most sweeps listed")
    ls.set_defaults(func=lambda a: _run(a, "list"))
    for name, help_text in (
        ("show", "a sweep's trials: parameters, metric, state, time"),
        ("cancel", "cancel its trials"),
    ):
        c = ps.add_parser(name, help=help_text)
        c.add_argument("sweep_id", metavar="SWEEP", help="the sweep's id, as `sweeps list` shows it")
        c.set_defaults(func=lambda a, n=name: _run(a, n))
