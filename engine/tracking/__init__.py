"""Experiment trackers: the run's metrics also go to TensorBoard, MLflow and W&B.

``start(config, ...)`` returns a ``Trackers`` sink (or None when the config's ``tracking`` asks
for none) that ``engine.training.run.train`` puts beside the caller's sink, so the command line
and the service's worker log the same way. Every tracker runs on a thread of its own
(``background``): a tracker that is down never fails or slows the run, and its metric points wait
(in memory, then in a spool file under the run folder) until it is back, in order; the run's end
waits a bounded time for them, and what is left is sent first by a resumed run. Problems reach
the run's sink as ``tracker`` events. Credentials come in ``TrackerSecrets`` (the service's
settings), never from the config, and are never logged. A tracking URI is checked by
``uri_problem`` (``engine.tracking.uris``); ``redact_url`` hides its credentials where it is
shown; TensorBoard writes under the run folder's ``TENSORBOARD_DIR``.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.kinds import EngineEvent
from engine.tracking.background import Background, RetryPolicy
from engine.tracking.spool import SPOOL_DIR, Point
from engine.tracking.trackers import TENSORBOARD_DIR
from engine.tracking.uris import file_path as uri_file_path
from engine.tracking.uris import problem as uri_problem
from engine.tracking.uris import redact_url
from engine.training.checkpoint_layout import CheckpointKind

if TYPE_CHECKING:
    from engine.config import TrainConfig
    from engine.metrics import Sink

__all__ = [
    "TENSORBOARD_DIR",
    "Point",
    "RetryPolicy",
    "RunInfo",
    "TrackerSecrets",
    "Trackers",
    "TrackingOptions",
    "flat_params",
    "redact_url",
    "start",
    "uri_file_path",
    "uri_problem",
]


@dataclass(frozen=True)
class TrackerSecrets:
    """Credentials of the trackers (from the service's settings); never shown in a repr."""

    wandb_api_key: str | None = field(default=None, repr=False)
    mlflow_token: str | None = field(default=None, repr=False)
    mlflow_username: str | None = field(default=None, repr=False)
    mlflow_password: str | None = field(default=None, repr=False)


@functools.lru_cache(maxsize=16)
def file_sha256(path: str) -> str:
    """The SHA-256 of a file ("" when it cannot be read)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return ""
    return digest.hexdigest()


@dataclass(frozen=True)
class RunInfo:
    """What the trackers record about a run besides its metrics."""

    name: str
    model: str
    dataset: str
    output_dir: Path
    params: dict[str, str | int | float | bool]
    dataset_file: str = ""
    sha256: str | None = None  # the dataset's, when the caller knows it (else hashed from the file)
    tags: dict[str, str] = field(default_factory=dict)

    def dataset_sha256(self) -> str:
        return self.sha256 if self.sha256 is not None else file_sha256(self.dataset_file)

    def described(self) -> dict[str, Any]:
        return {"model": self.model, "dataset": self.dataset, **self.params}


def flat_params(config: TrainConfig) -> dict[str, str | int | float | bool]:
    """The run's hyperparameters as flat ``section.field`` values (paths and trackers left out)."""
    raw = config.model_dump(mode="json", exclude={"tracking": True, "output_dir": True, "model": {"path"}})
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("train", "validation")}
    out: dict[str, str | int | float | bool] = {}
    for section, values in raw.items():
        for key, value in (values or {}).items():
            if value is None:
                continue
            out[f"{section}.{key}"] = value if isinstance(value, str | int | float | bool) else str(value)
    return out


class Tracker(Protocol):
    name: str
    batch: int  # points per ``log`` call at most

    def start(self, info: RunInfo) -> None: ...

    def log(self, points: list[Point]) -> None: ...

    def finish(self, summary: dict[str, float], status: str, export: Path | None) -> None: ...


class Trackers:
    """A Sink that hands every metric to each tracker's background thread, remembers the latest
    value of each (the summary) and the last checkpoint (the export an MLflow run may keep)."""

    def __init__(
        self, trackers: list[Tracker], info: RunInfo, *, warn: Callable[..., None], policy: RetryPolicy
    ) -> None:
        self.latest: dict[str, float] = {}
        self.export: Path | None = None
        self.finished = False
        self.runs: list[tuple[Tracker, Background]] = []
        for tracker in trackers:
            background = Background(
                tracker.name,
                start=functools.partial(tracker.start, info),
                send=tracker.log,
                spool=info.output_dir / SPOOL_DIR / f"{tracker.name}.jsonl",
                warn=warn,
                policy=policy,
                batch=tracker.batch,
            )
            self.runs.append((tracker, background))

    @property
    def names(self) -> list[str]:
        return [t.name for t, _ in self.runs]

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.latest.update(metrics)
        point = Point(step, dict(metrics), int(time.time() * 1000))
        for _, background in self.runs:
            background.log(point)

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        pass

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        self.export = Path(path)

    def finish(self, status: str) -> None:
        """Send the summary and the outcome, then wait (bounded) for every tracker to be done."""
        if self.finished:
            return
        self.finished = True
        summary = {k: v for k, v in self.latest.items() if not k.startswith(("time/", "transfer/"))}
        closers = [
            threading.Thread(
                target=b.close, args=(functools.partial(t.finish, summary, status, self.export),), daemon=True
            )
            for t, b in self.runs
        ]
        for closer in closers:  # side by side: the wait is the slowest tracker's, not their sum
            closer.start()
        for closer in closers:
            closer.join()

    def close(self) -> None:
        self.finish("cancelled")


@dataclass(frozen=True)
class TrackingOptions:
    """What the caller of a run tells its trackers beyond the config.

    Attributes:
        secrets: credentials (None: those the trackers' own environment variables give).
        name: the run's name in the trackers (default: the output folder's name).
        dataset, dataset_sha256: the training data's name and hash (default: the file's name
            and its hash, computed in the background).
        tags: more tags (MLflow) for the run.
        policy: the retry policy and the queue's bound (tests shorten them).
    """

    secrets: TrackerSecrets = field(default_factory=TrackerSecrets)
    name: str | None = None
    dataset: str | None = None
    dataset_sha256: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    policy: RetryPolicy = field(default_factory=RetryPolicy)


def start(
    config: TrainConfig,
    *,
    warn: Callable[[str, dict[str, Any]], None],
    options: TrackingOptions | None = None,
) -> Trackers | None:
    """The trackers ``config.tracking`` asks for, started in the background (None: none asked);
    ``warn`` receives ``(message, data)`` for each tracker problem."""
    from engine.tracking.trackers import MlflowTracker, TensorBoardTracker, WandbTracker

    spec, options = config.tracking, options or TrackingOptions()
    trackers: list[Tracker] = []
    if spec.tensorboard:
        trackers.append(TensorBoardTracker())
    if spec.mlflow is not None:
        trackers.append(MlflowTracker(spec.mlflow, options.secrets))
    if spec.wandb is not None:
        trackers.append(WandbTracker(spec.wandb, options.secrets))
    if not trackers:
        return None
    output = Path(config.output_dir)
    info = RunInfo(
        name=options.name or output.name,
        model=config.model.name or config.model.path,
        dataset=options.dataset or Path(config.data.train).name,
        output_dir=output,
        params=flat_params(config),
        dataset_file=config.data.train,
        sha256=options.dataset_sha256,
        tags=dict(options.tags),
    )
    return Trackers(trackers, info, warn=warn, policy=options.policy)


def warn_into(sink: Sink, lock: threading.Lock) -> Callable[[str, dict[str, Any]], None]:
    """A tracker's warnings as ``tracker`` events of ``sink``, serialised with the run's calls."""

    def warn(message: str, data: dict[str, Any]) -> None:
        with lock:
            sink.event(EngineEvent.TRACKER, message, {**data, "time": time.time()})

    return warn
