"""Evaluations on the worker: the task's body (claim, run the child, record the outcome) and the
child process itself, ``python -m server.worker.evaluator EVALUATION_ID``.

A worker runs one task at a time, so an evaluation sent while the worker trains a job waits in
the queue and runs after it (on another idle worker sooner). The child loads the checkpoint on
the first GPU when it fits there, else on the CPU (``engine.inference.evaluate.pick_device``), scores it,
and writes the result into the checkpoint folder; like the training child, it is a fresh
interpreter, so the pool process never imports torch and survives a crash of the evaluation.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from server.services import checkpoints, datasets, evaluations, jobs
from server.settings import Settings, get_settings
from server.tables import now
from server.worker import files
from server.worker.children import die_with_parent

log = logging.getLogger("roundhouse.worker")
EXIT_OK, EXIT_FAILED = 0, 1


def _files(settings: Settings, evaluation_id: str) -> tuple[Path, Path]:
    """The child's log and the file its error message goes to (beside the worker's other files)."""
    folder = settings.home.resolve() / "evaluations"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{evaluation_id}.log", folder / f"{evaluation_id}.error"


def supervise_evaluation(
    settings: Settings, sessions: sessionmaker[Session], *, evaluation_id: str, worker_id: str
) -> str:
    """Run one evaluation to its outcome. Returns what happened (for the worker's log)."""
    with sessions() as session:
        if not evaluations.claim(session, evaluation_id=evaluation_id, worker_id=worker_id):
            return "not claimable (taken or finished)"
    log_file, error_file = _files(settings, evaluation_id)
    error_file.unlink(missing_ok=True)
    env = {**os.environ, **settings.child_environment()}
    with log_file.open("ab") as out:
        rc = subprocess.call(
            [sys.executable, "-m", "server.worker.evaluator", evaluation_id],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )
    with sessions() as session:
        row = evaluations.get(session, evaluation_id=evaluation_id)
        store = files.open_store(settings)
        result = evaluations.read_result(row, store) if row is not None and rc == EXIT_OK else None
        if result is not None:
            evaluations.finish(
                session,
                evaluation_id=evaluation_id,
                worker_id=worker_id,
                path=row.path if row is not None else None,
                metrics=evaluations.summary(result),
            )
            return "succeeded"
        if error_file.is_file():
            error = error_file.read_text().strip()
        elif rc < 0:
            error = f"the evaluation process was killed by {signal.Signals(-rc).name}; see {log_file}"
        else:
            error = f"the evaluation process exited with code {rc}; see {log_file}"
        evaluations.finish(session, evaluation_id=evaluation_id, worker_id=worker_id, error=error)
        return f"failed: {error}"


def resume(settings: Settings, sessions: sessionmaker[Session], *, worker_id: str) -> list[str]:
    """At a worker's start: requeue the evaluations of vanished workers (this one included) and
    send every queued evaluation again (its message may be lost). Returns the ids sent."""
    from server.queue import send_evaluation

    silent_before = now() - timedelta(seconds=settings.lease_seconds)
    with sessions() as session:
        queued = evaluations.requeue_abandoned(session, worker_id=worker_id, silent_before=silent_before)
    for evaluation_id in queued:
        send_evaluation(settings, evaluation_id)
    return queued


def _evaluate(settings: Settings, sessions: sessionmaker[Session], evaluation_id: str) -> None:
    """Score the evaluation's checkpoint and write its result file; the row records its path."""
    with sessions() as session:
        row = evaluations.get(session, evaluation_id=evaluation_id)
        if row is None:
            raise ValueError(f"no evaluation {evaluation_id}")
        job = jobs.get_job(session, job_id=row.job_id)
        checkpoint = checkpoints.get(session, job_id=row.job_id, step=row.step)
        dataset = datasets.get_dataset(session, dataset_id=row.dataset_id)
        if job is None or checkpoint is None:
            raise ValueError(f"the checkpoint at step {row.step} is gone (pruned by checkpoint.keep_last?)")
        if dataset is None:
            raise ValueError(f"dataset {row.dataset_id} was deleted")
        config: dict[str, Any] = dict(job.config)
        key, kind, data, name = checkpoint.path, checkpoint.kind, dataset.path, dataset.name
        base_model = job.base_model
        limits: dict[str, Any] = {
            "max_rows": row.max_rows,
            "max_new_tokens": row.max_new_tokens,
            "samples": row.num_samples,
        }
        about = {"id": row.id, "job_id": row.job_id, "step": row.step, "dataset_id": row.dataset_id}
    from engine.inference import evaluate_checkpoint
    from engine.model import resolve_model_path

    # the checkpoint, the dataset and the base model here: the store's own files, or pulled into
    # home/cache where the store is remote (``server.worker.files``)
    store = files.open_store(settings)
    key = checkpoints.run_key(key)
    folder = checkpoints.export_folder(store, key, cache=settings.home.resolve() / files.CACHE)
    # a dataset with images: the store's image folder, or its images pulled into home/cache
    image_store = datasets.local_images(store, dataset, cache=settings.home.resolve() / files.CACHE)
    data = files.fetch_file(settings, store, data, field="dataset_id")
    model = str(config.get("model", {}).get("path", "demo"))
    if kind == "adapter":
        base = resolve_model_path(
            files.fetch_model(settings, store, path=model, name=base_model), settings.models_dir
        )
    else:
        base = None
    max_length = int(config.get("data", {}).get("max_length", 1024))
    result = evaluate_checkpoint(
        folder,
        data,
        base=base,
        max_length=max_length,
        image_store=None if image_store is None else str(image_store),
        **limits,
    )
    result["evaluation"] = about | {"dataset_name": name, "finished_at": now().isoformat()}
    result_key = evaluations.result_path(key, evaluation_id).as_posix()
    own = store.local_path(result_key)  # the local store's file; else written beside the log, then put
    path = own if own is not None else _files(settings, evaluation_id)[0].with_suffix(".json")
    evaluations.write_result(path, result)
    if own is None:
        store.put_file(result_key, path)
    with sessions() as session:
        row = evaluations.get(session, evaluation_id=evaluation_id)
        if row is not None:
            row.path = result_key
            session.commit()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m server.worker.evaluator EVALUATION_ID", file=sys.stderr)
        return EXIT_FAILED
    settings = get_settings()
    from server.db import make_engine, session_factory

    sessions = session_factory(make_engine(settings.url))
    try:
        _evaluate(settings, sessions, argv[0])
    except Exception as exc:
        traceback.print_exc()
        _, error_file = _files(settings, argv[0])
        error_file.write_text(f"{type(exc).__name__}: {exc}"[:4000])
        return EXIT_FAILED
    print(f"evaluation {argv[0]} written", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
