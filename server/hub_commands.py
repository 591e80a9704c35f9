"""``roundhouse models pull``, ``roundhouse datasets pull`` and ``roundhouse checkpoints push``: the
Hub transfers of ``/api/models/pulls``, ``/api/datasets/pulls`` and ``/api/jobs/{id}/checkpoints/
{step}/push`` from the command line, on the settings' database. Each is checked and queued here
(a refusal says what the API's error says, with the setting to change) and run by a worker; the
command prints its progress until it ends (Ctrl-C stops following, not the transfer)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from server.settings import Settings, get_settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from server.hf_hub.child import HubError
    from server.services.failures import Refusal


def cmd_models_pull(args: argparse.Namespace) -> int:
    """Pull a model from the Hub (``POST /api/models/pulls`` does the same): checked here, downloaded
    by a worker; prints the progress until it is done."""
    from server.db import migrated_sessions
    from server.hf_hub.child import HubError
    from server.services import hub
    from server.services.failures import Refusal

    settings = get_settings()
    sessions = migrated_sessions(settings.url)
    with sessions() as session:
        try:
            row, created = hub.request_pull(session, settings, repo_id=args.repo_id, revision=args.revision)
        except (HubError, Refusal) as exc:
            return _refused(exc, settings, args)
        transfer_id = row.id
        doing = "pulling" if created else "already pulling"
        print(f"{doing} {args.repo_id} ({row.bytes_total:,} bytes): {transfer_id}")
    return 0 if args.no_wait else follow(sessions, transfer_id, label=args.repo_id)


def cmd_datasets_pull(args: argparse.Namespace) -> int:
    """Pull a dataset split from the Hub (``POST /api/datasets/pulls`` does the same): checked here,
    downloaded and stored like an upload by a worker; prints the progress until it is done."""
    from server.db import migrated_sessions
    from server.hf_hub.child import HubError
    from server.services import hub
    from server.services.failures import Refusal

    settings = get_settings()
    sessions = migrated_sessions(settings.url)
    with sessions() as session:
        try:
            row, created = hub.request_dataset_pull(
                session,
                settings,
                repo_id=args.repo_id,
                split=args.split,
                config=args.config,
                revision=args.revision,
                name=args.name,
            )
        except (HubError, Refusal) as exc:
            return _refused(exc, settings, args)
        transfer_id = row.id
        doing = "pulling" if created else "already pulling"
        print(f"{doing} {args.repo_id} split {args.split!r} ({row.bytes_total:,} bytes): {transfer_id}")
    return 0 if args.no_wait else follow(sessions, transfer_id, label=args.repo_id)


def cmd_checkpoints_push(args: argparse.Namespace) -> int:
    """Push a checkpoint to a Hub repo in an export format (``--format``, ``--variant``; the
    hidden ``--merged`` is the older ``--format merged``), as ``POST /api/jobs/{id}/checkpoints/
    {step}/push`` does: queued here, built and uploaded by a worker; prints the progress until it
    is done."""
    from engine.export import CHECKPOINT, MERGED
    from server.db import migrated_sessions
    from server.hf_hub.child import HubError
    from server.services import hub, jobs
    from server.services.failures import Refusal
    from server.storage import open_storage

    settings = get_settings()
    if args.merged and args.format not in (None, MERGED.name):
        print(
            f"--merged: the same as --format merged; leave it out beside --format {args.format}",
            file=sys.stderr,
        )
        return 2
    format = MERGED.name if args.merged else args.format or CHECKPOINT.name
    sessions = migrated_sessions(settings.url)
    with sessions() as session:
        job = jobs.get_job(session, job_id=args.job_id)
        if job is None:
            print(f"JOB: no job {args.job_id!r}", file=sys.stderr)
            return 1
        try:
            row, created = hub.request_push(
                session,
                settings,
                open_storage(settings),
                job=job,
                step=args.step,
                repo_id=args.repo_id,
                private=args.private,
                format=format,
                variant=args.variant,
            )
        except (HubError, Refusal) as exc:
            return _refused(exc, settings, args)
        transfer_id, target = row.id, row.target
    doing = "pushing" if created else "already pushing"
    print(f"{doing} step {args.step} of job {args.job_id} ({format}) to {target}: {transfer_id}")
    return 0 if args.no_wait else follow(sessions, transfer_id, label=args.repo_id)


def _refused(exc: HubError | Refusal, settings: Settings, args: argparse.Namespace) -> int:
    """Say why a Hub request was refused, in the API's words (a Hub that cannot be reached names
    ``ROUNDHOUSE_HUB_ENDPOINT``, a gated repo ``ROUNDHOUSE_HUB_TOKEN``), and fail."""
    from server.api.hub import refused
    from server.hf_hub.child import HubError

    revision = getattr(args, "revision", None)
    message = (
        refused(exc, settings, repo_id=args.repo_id, revision=revision).message
        if isinstance(exc, HubError)
        else exc.message
    )
    print(f"{args.repo_id}: {message}", file=sys.stderr)
    return 1


def follow(sessions: sessionmaker[Session], transfer_id: str, *, label: str) -> int:
    """Print a transfer's progress every 2 s until it ends (Ctrl-C stops following, not it)."""
    from server.hf_hub.runner import transfer_payload
    from server.services import transfers

    while True:
        with sessions() as session:
            found = transfers.get(session, transfer_id=transfer_id)
            if found is None:
                print(f"{label}: the transfer {transfer_id} is gone", file=sys.stderr)
                return 1
            now = transfer_payload(found)
        speed = f", {now['bytes_per_s'] / 1e6:.1f} MB/s" if now["bytes_per_s"] else ""
        print(f"  {now['status']}: {now['bytes_done']:,} of {now['bytes_total']:,} bytes{speed}", flush=True)
        if now["status"] in transfers.TERMINAL:
            if now["error"]:
                print(f"{label}: {now['error']}", file=sys.stderr)
            elif now["kind"] == transfers.PUSH:
                print(f"{label}: {now['target']} (commit {now['commit']})")
            elif now["kind"] == transfers.DATASET_PULL:
                print(f"{label}: dataset {now['dataset_id']} ({now['target']}, commit {now['commit']})")
            return 0 if now["status"] == transfers.SUCCEEDED else 1
        time.sleep(2)


def add_parsers(sub: Any, *, models: Any, checkpoints: Any) -> None:
    """``models pull``, ``checkpoints push`` (in those groups) and the ``datasets`` group."""
    from engine.export import FORMATS, VARIANTS, formats_help, variants_help

    mpl = models.add_parser(
        "pull", help="pull a model from the Hugging Face Hub into the models folder (a worker downloads it)"
    )
    mpl.add_argument("repo_id", metavar="ORG/NAME", help="the Hub repo, e.g. Qwen/Qwen3-0.6B")
    mpl.add_argument("--revision", help="a branch, tag or commit (default: main)")
    mpl.add_argument("--no-wait", action="store_true", help="queue it and return")
    mpl.set_defaults(func=cmd_models_pull)
    d = sub.add_parser("datasets", help="datasets from the Hugging Face Hub")
    ds = d.add_subparsers(dest="datasets_command", required=True)
    dpl = ds.add_parser(
        "pull", help="pull a dataset split from the Hugging Face Hub and store it like an upload (a worker)"
    )
    dpl.add_argument("repo_id", metavar="ORG/NAME", help="the Hub dataset repo, e.g. HuggingFaceH4/no_robots")
    dpl.add_argument("--split", default="train", help="the split (default: train)")
    dpl.add_argument("--config", help="the subset (config), when the repo has several")
    dpl.add_argument("--revision", help="a branch, tag or commit (default: main)")
    dpl.add_argument("--name", help='the dataset\'s name (default: "ORG/NAME (SPLIT)")')
    dpl.add_argument("--no-wait", action="store_true", help="queue it and return")
    dpl.set_defaults(func=cmd_datasets_pull)
    cp = checkpoints.add_parser(
        "push", help="push a checkpoint to a Hugging Face Hub repo with a model card (a worker uploads it)"
    )
    cp.add_argument("job_id", metavar="JOB", help="the job's id")
    cp.add_argument("step", metavar="STEP", type=int, help="the checkpoint's step")
    cp.add_argument("repo_id", metavar="ORG/NAME", help="the Hub repo, created if needed")
    cp.add_argument("--private", action="store_true", help="create the repo private")
    cp.add_argument("--format", choices=list(FORMATS), help=f"the export pushed: {formats_help()}")
    cp.add_argument("--variant", choices=list(VARIANTS), help=variants_help())
    cp.add_argument("--merged", action="store_true", help=argparse.SUPPRESS)  # deprecated: --format merged
    cp.add_argument("--no-wait", action="store_true", help="queue it and return")
    cp.set_defaults(func=cmd_checkpoints_push)
