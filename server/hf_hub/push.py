"""A checkpoint pushed to a Hub repo (the worker's side of a ``push`` transfer) in one of the
export formats (``engine.export.formats``): its own files (the adapter, or the full model), the
adapter merged into its base, or a GGUF folder for llama.cpp and Ollama; built by the format's
builder in the Hub client's child process, then committed with a model card in one commit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from engine.export import CHECKPOINT, MERGED, ExportFormat, format_named
from server.hf_hub import child
from server.hf_hub.progress import Reporter
from server.services import archives, checkpoints, datasets, jobs, transfers
from server.services.checkpoints import STATE
from server.settings import Settings
from server.storage import open_storage
from server.tables import HubTransfer

LEAVE_OUT = (STATE, "evaluations", "README.md")


def explain(exc: child.HubError, settings: Settings, *, repo_id: str) -> tuple[str, str]:
    """A failed push's error code and message: what the Hub said and which setting to change."""
    namespace = repo_id.split("/")[0] if "/" in repo_id else "your account"
    if exc.kind in ("forbidden", "gated", "repo_not_found"):
        status = f" (HTTP {exc.status})" if exc.status else ""
        todo = (
            f"the token in ROUNDHOUSE_HUB_TOKEN cannot write to {namespace!r}: give it write access"
            " (a fine-grained token needs write on that namespace) or push to a repo of its account"
            if settings.hub_token is not None
            else f"set ROUNDHOUSE_HUB_TOKEN to a token with write access to {namespace!r}"
        )
        return "hub_forbidden", f"the Hub refused the push to {repo_id}{status}: {todo}"
    if exc.kind == "unreachable":
        return "hub_unreachable", (
            f"the Hub at {settings.hub_endpoint} (ROUNDHOUSE_HUB_ENDPOINT) cannot be reached: {exc.message}"
        )
    if exc.kind == "offline":
        return "hub_offline", exc.message
    if exc.kind in ("disk_full", "export_failed"):
        return exc.kind, exc.message
    return "hub_error", f"the push to {repo_id} failed: {exc.message}"


def push_format(plan: dict[str, Any]) -> ExportFormat:
    """The export format a push's plan asks for (a plan queued before pushes had formats says
    ``merged``: true or false)."""
    return format_named(str(plan.get("format") or (MERGED.name if plan.get("merged") else CHECKPOINT.name)))


def run_push(settings: Settings, sessions: sessionmaker[Session], row: HubTransfer, worker_id: str) -> str:
    from engine.model import base_model_name

    plan = dict(row.plan)
    storage = open_storage(settings)
    with sessions() as session:
        job = jobs.get_job(session, job_id=plan["job_id"])
        checkpoint = checkpoints.get(session, job_id=plan["job_id"], step=plan["step"], storage=storage)
        if job is None or checkpoint is None:
            transfers.finish(
                session,
                transfer_id=row.id,
                status=transfers.FAILED,
                error=f"job {plan['job_id']!r} has no checkpoint at step {plan['step']} any more",
                error_code="not_found",
            )
            return transfers.FAILED
        ids = [job.dataset_id] + ([job.validation_dataset_id] if job.validation_dataset_id else [])
        rows = [d for d in (datasets.get_dataset(session, dataset_id=i) for i in ids) if d is not None]
        hub_ids = [str(d.source["hub"]) for d in rows if d.source and d.source.get("hub")]
        names = [d.name for d in rows]
        session.expunge_all()
    model = job.config["model"]
    base_name = base_model_name(model.get("name"), Path(model["path"]))
    export = push_format(plan)
    variant = export.variant_of(plan.get("variant"))
    kind = export.what(checkpoint.kind)  # adapter, full, merged, gguf
    tag = export.tag(checkpoint.kind, variant)  # adapter, merged, gguf-q8_0
    source = checkpoints.export_folder(storage, storage.key_of(checkpoint.path), cache=settings.cache_dir)
    base = (
        archives.base_path(job, settings=settings, storage=storage)
        if export.needs_base(checkpoint.kind)
        else None
    )
    fixed = checkpoints.adapter_config(source, base_name=base_name) if kind == "adapter" else {}
    if export is CHECKPOINT:  # a VLM checkpoint written without its processor files gets its base's
        fixed |= archives.processor_files(job, source, settings=settings, storage=storage)
    work = settings.cache_dir / "hub-push" / row.id
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # built by the format's builder in the child (the worker never runs torch), as a download is
    build = {
        "format": export.name,
        "variant": variant,
        "source": str(source),
        "base": base,
        "models_dir": str(settings.models_dir),
        "system": archives.system_prompt(job, storage),
        "comment": f"{row.repo_id}: step {checkpoint.step} of the Roundhouse fine-tune {job.name!r}",
        "out": str(work / "export"),
    }
    card = {
        "repo_id": row.repo_id,
        "kind": kind,
        "variant": variant,
        "base_model": base_name,
        "job_name": job.name,
        "step": checkpoint.step,
        "config": job.config,
        "datasets": hub_ids,
        "dataset_names": names,
        "metrics": checkpoint.metrics or {},
    }
    reporter = Reporter(settings, sessions, row, worker_id)
    try:
        result = child.run(
            settings,
            "push",
            on_progress=reporter.progress,
            on_total=reporter.total,
            cancelled=reporter.cancelled,
            repo_id=row.repo_id,
            private=bool(plan.get("private")),
            build=build,
            leave_out=list(LEAVE_OUT),
            replace={name: data.decode() for name, data in fixed.items()},
            card=card,
            message=f"Roundhouse: {job.name}, step {checkpoint.step} ({tag})",
        )
    except child.Cancelled:
        with sessions() as session:
            transfers.finish(session, transfer_id=row.id, status=transfers.CANCELLED, error="cancelled")
        return transfers.CANCELLED
    except child.HubError as exc:
        code, message = explain(exc, settings, repo_id=row.repo_id)
        with sessions() as session:
            transfers.finish(
                session, transfer_id=row.id, status=transfers.FAILED, error=message, error_code=code
            )
        return transfers.FAILED
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = int(result.get("bytes") or 0)
    plan |= {"commit": result.get("commit"), "files": result.get("files", []), "kind": kind}
    with sessions() as session:
        transfers.finish(
            session,
            transfer_id=row.id,
            status=transfers.SUCCEEDED,
            target=str(result.get("url") or row.target),
            bytes_done=size,
            bytes_total=size,
            plan=json.loads(json.dumps(plan)),
        )
    return transfers.SUCCEEDED
