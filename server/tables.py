"""Database tables (SQLAlchemy 2). API shapes live in ``server/schemas.py``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, DateTime, Dialect, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def now() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite keeps no zone: it stores naive UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    filename: Mapped[str] = mapped_column(String(255))
    path: Mapped[str] = mapped_column(Text)
    format: Mapped[str] = mapped_column(String(32))
    rows: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
    # where it came from when not uploaded: {"hub": repo, "config", "split", "revision", "files"}
    source: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # deleted while finished jobs still name it: its file is gone, the row stays for them
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_created", "status", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16), index=True)  # a kinds.JobStatus
    base_model: Mapped[str] = mapped_column(String(255))
    dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    validation_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"), nullable=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    output_dir: Mapped[str] = mapped_column(Text)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # the last time its message went to the broker (None: a send is pending), and how many went
    sent_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    sends: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # training restarts
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    # the OpenAI-compatible API's: the caller's metadata (string pairs; null: none given) and the
    # suffix of its fine-tuned model's name ("metadata" itself is taken by SQLAlchemy)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON(none_as_null=True), nullable=True)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # where it may run: {"host": name | None, "gpus": count | None} (``services.placement``); null: anywhere
    placement: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    # the sweep it is a trial of (``services.sweeps``); null: a job of its own
    sweep_id: Mapped[str | None] = mapped_column(
        ForeignKey("sweeps.id", ondelete="SET NULL"), nullable=True, index=True
    )
    # tokens of the batches of steps 1..step (padding left out), and when its run expects to end
    # (``services.progress``); null until its first step
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    estimated_finish: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class Sweep(Base):
    """A search over a job's hyperparameters: its trials are ordinary jobs naming it (``sweep_id``)."""

    __tablename__ = "sweeps"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    # the request: base job body, search, parameters, trials, metric, goal, early stopping
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # the trials in order: [{"job_id", "params"}]
    trials: Mapped[list[Any]] = mapped_column(JSON, default=list)
    # what the planner said before it started: {"eta_s", "trials": [{"fits", "eta_s", ...}]}
    plan: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now, index=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))  # a kinds.EventKind
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))  # adapter | full
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class Worker(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    devices: Mapped[list[Any]] = mapped_column(JSON, default=list)
    cpu: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    message: Mapped[str] = mapped_column(Text, default="")
    sampled_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
    # its inference service (server/worker/inference.py): where it answers, and its bearer token
    inference_url: Mapped[str | None] = mapped_column(String(255), nullable=True)
    inference_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # where the other boxes of a job on several hosts reach it (``services.boxes``): its advertised
    # address, its rendezvous port, its NIC and that NIC's nominal speed, and the all-reduce rate
    # its last job on several hosts measured (null: unknown, or an older worker)
    address: Mapped[str | None] = mapped_column(String(255), nullable=True)
    rendezvous_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    interface: Mapped[str | None] = mapped_column(String(64), nullable=True)
    link_gbps: Mapped[float | None] = mapped_column(Float, nullable=True)
    link_measured_gbps: Mapped[float | None] = mapped_column(Float, nullable=True)


class JobBox(Base):
    """One host reserved for a job on several hosts (``services.boxes``): its rank in the job's
    current run (``generation``: the job's attempt that reserved it) and where its worker is. A
    host holds one such row at a time (unique), so two reservations never share a host; the rows
    of a run are inserted in one transaction and deleted when it ends."""

    __tablename__ = "job_boxes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    generation: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    hostname: Mapped[str] = mapped_column(String(255), unique=True)
    worker_id: Mapped[str] = mapped_column(String(255))
    address: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer)
    # renewed by its box's worker while it runs; a box silent past it is lost (``boxes.sweep``)
    lease_until: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(255))
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class BrowserSession(Base):
    """A one-time login link and, once it was used, the browser session it started; both belong to
    an API key and end with it. Only hashes of the link's token and the cookie are stored."""

    __tablename__ = "browser_sessions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    link_hash: Mapped[str] = mapped_column(String(64), unique=True)
    link_expires_at: Mapped[datetime] = mapped_column(UTCDateTime())
    used_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    session_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)


class Evaluation(Base):
    """A checkpoint of a job scored on a dataset (``engine.inference.evaluate``) by a worker. The whole
    result, samples included, is a JSON file in the checkpoint folder (``path``); the row indexes it
    and keeps its summary figures (``metrics``)."""

    __tablename__ = "evaluations"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    # no foreign key: deleting a dataset keeps the evaluations made with it
    dataset_id: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # queued | running | succeeded | failed
    max_rows: Mapped[int] = mapped_column(Integer)
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    num_samples: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    path: Mapped[str | None] = mapped_column(Text, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class HubTransfer(Base):
    """A transfer with the Hugging Face Hub run by a worker: a model pulled into the models folder
    (``kind`` "pull") or a checkpoint pushed to a repo ("push"). No token is ever stored here."""

    __tablename__ = "hub_transfers"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # pull | push | dataset_pull
    repo_id: Mapped[str] = mapped_column(String(255), index=True)
    revision: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # while queued or running, else null: one active transfer per target ("pull:<repo>" for a model,
    # "dataset:<repo>@<commit>:<config>/<split>" for a dataset's split)
    active_key: Mapped[str | None] = mapped_column(String(600), unique=True, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # queued|running|cancelling|succeeded|...
    # what to move: a pull's files [{path, size}] and commit; a push's job, step, private, merged
    plan: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    target: Mapped[str] = mapped_column(Text)  # a pull's model name; a push's repo URL once known
    bytes_total: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    progress_seq: Mapped[int] = mapped_column(Integer, default=0)  # bumped on every change
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    worker_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=now, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
