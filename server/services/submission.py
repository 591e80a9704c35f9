"""Submitting a job: a request checked (base model, datasets, TrainConfig), stored queued and sent
to the workers; what ``POST /api/jobs`` and ``POST /v1/fine_tuning/jobs`` do, and a resume's send."""

from __future__ import annotations

from sqlalchemy.orm import Session

from engine import ConfigError
from server import queue
from server.kinds import EventKind
from server.schemas import JobCreate
from server.services import boxes, datasets, gpus, jobs, models, placement
from server.services.failures import Invalid, NotFound
from server.settings import Settings
from server.storage import Storage
from server.tables import Job


def send(session: Session, *, settings: Settings, job_id: str) -> None:
    """Send a queued job to the workers; if the broker is down the job is kept, and a worker's
    reconcile sends it when the broker answers."""
    job = jobs.get_job(session, job_id=job_id)
    try:
        queue.enqueue(settings, job_id, where=job.placement if job is not None else None)
    except Exception as exc:
        jobs.send_failed(session, job_id=job_id)
        jobs.add_event(
            session,
            job_id=job_id,
            kind=EventKind.LOG,
            message=f"the job queue is unreachable ({exc}); the job is sent when it answers",
            data={"send_pending": True},
        )


def submit(session: Session, *, request: JobCreate, settings: Settings, storage: Storage) -> Job:
    """Check a job request (base model, datasets, TrainConfig), store the job queued and send it.
    Its datasets' images are read from the service's image store: ``data.image_store`` is set here
    (``datasets.image_store``), never by the request.

    Raises:
        NotFound: no such base model or dataset (naming the field).
        Invalid: a base model that cannot be fine-tuned, or an invalid TrainConfig section (naming
            the field), or data the method does not train on, or a batch too small for the hosts
            its placement asks for (``hyper.batch_size``).
    """
    model = models.find(request.base_model, settings.models_dir, settings.hf_cache_dir)
    if model is None:
        raise NotFound(f"no base model {request.base_model!r} (see GET /api/models)", param="base_model")
    if not model.supported:  # refused now, not failed later by the worker
        raise Invalid(
            "unsupported_model",
            f"base model {request.base_model!r} cannot be fine-tuned: {model.unsupported_reason}",
            param="base_model",
        )
    train = datasets.get_dataset(session, dataset_id=request.dataset_id)
    if train is None:
        raise NotFound(f"no dataset {request.dataset_id!r}", param="dataset_id")
    validation = None
    if request.validation_dataset_id is not None:
        validation = datasets.get_dataset(session, dataset_id=request.validation_dataset_id)
        if validation is None:
            raise NotFound(f"no dataset {request.validation_dataset_id!r}", param="validation_dataset_id")
    ident = jobs.new_id()
    output_dir = jobs.run_key(ident)
    try:
        config = jobs.build_config(
            request=request.model_dump(),
            model_path=model.path if model.path is not None else request.base_model,
            train_path=jobs.config_path(storage, storage.key_of(train.path)),
            validation_path=jobs.config_path(storage, storage.key_of(validation.path))
            if validation
            else None,
            output_dir=jobs.config_path(storage, output_dir),
            home=settings.home,
            image_store=datasets.image_store(storage, train, validation),
        )
        jobs.check_formats(config=config, train=train, validation=validation)  # dpo: preference data
        boxes.check_batch(config, request.placement.model_dump() if request.placement else None)
    except ValueError as exc:
        param = exc.field if isinstance(exc, ConfigError) else None
        raise Invalid("invalid_config", str(exc), param=param) from exc
    job = jobs.create_job(
        session,
        ident=ident,
        name=request.name,
        base_model=request.base_model,
        dataset_id=train.id,
        dataset_name=train.name,
        validation_dataset_id=validation.id if validation else None,
        config=config,
        output_dir=output_dir,
    )
    where = placement.normalized(request.placement.model_dump() if request.placement else None)
    if where is not None:
        placement.record(
            session,
            job=job,
            where=where,
            hosts=gpus.hosts(session, stale_after=settings.telemetry_seconds * 5),
        )
    send(session, settings=settings, job_id=job.id)
    return job
