"""What the boxes of one job must agree on before they train: a batch that gives every box its
micro-batches (``required_rows``) and the same job on every box (``check_same_job``); and what a
box other than rank 0 reports (``events_only``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.config import TrainConfig
    from engine.distributed.group import Group
    from engine.metrics import Sink
    from engine.training.checkpoint_layout import CheckpointKind

HASH_CHUNK = 1 << 20


def required_rows(config: TrainConfig, boxes: int) -> None:
    """Refuse a batch too small to give each of ``boxes`` its ``engine.num_microbatches``.

    A batch's rows are shared out as micro-batches: ``num_microbatches`` per box, so a batch
    needs ``boxes x num_microbatches`` examples (pairs, for the preference methods). A method
    that samples a group of completions per prompt (GRPO) shares out the prompts: each box needs
    a prompt, and its prompts' completions must fill its micro-batches.

    Raises:
        ConfigError: (field ``hyper.batch_size``) the batch cannot be shared out.
    """
    batch, m = config.hyper.batch_size, config.engine.num_microbatches
    group = getattr(config.method, "group_size", None)
    if isinstance(group, int):  # prompts, each sampled ``group`` times
        if batch < boxes or (batch // boxes) * group < m:
            raise ConfigError(
                "hyper.batch_size",
                f"hyper.batch_size={batch}: {boxes} boxes need at least {boxes} prompts, and each "
                f"box's prompts x method.group_size={group} completions must fill "
                f"engine.num_microbatches={m}",
                value=batch,
            )
        return
    if batch < boxes * m:
        raise ConfigError(
            "hyper.batch_size",
            f"hyper.batch_size={batch}: {boxes} boxes with engine.num_microbatches={m} each need a "
            f"batch of at least {boxes * m} (or fewer micro-batches per box)",
            value=batch,
        )


def _file_digest(path: str | None) -> str | None:
    if path is None:
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _model_digest(config: TrainConfig, models_dir: Path) -> str:
    from engine.model.loading import resolve_model_path

    folder = resolve_model_path(config.model.path, models_dir)
    found = Path(folder) / "config.json"
    return _file_digest(str(found)) or "" if found.is_file() else str(config.model.path)


def job_fingerprint(config: TrainConfig, models_dir: Path) -> dict[str, Any]:
    """What must be the same on every box, by field: the model's config, the data files' bytes,
    the method, the hyperparameters and what in the engine changes the numbers (each box's
    devices and partition may differ: the result does not depend on them)."""
    data = config.data.model_dump(mode="json", exclude={"train", "validation", "image_store"})
    engine = config.engine
    return {
        "model": _model_digest(config, models_dir),
        "data.train": _file_digest(config.data.train),
        "data.validation": _file_digest(config.data.validation),
        "data": data,
        "method": config.method.model_dump(mode="json"),
        "hyper": config.hyper.model_dump(mode="json"),
        "engine": {
            "num_microbatches": engine.num_microbatches,
            "async_optimizer": engine.async_optimizer,
            "compute_dtype": engine.compute_dtype,
        },
    }


def check_same_job(group: Group, config: TrainConfig, models_dir: Path) -> None:
    """Every box compares its job with rank 0's.

    Raises:
        ConfigError: a box trains another model, other data or other settings (the field and
            the box are named); every box raises it, so all stop.
    """
    mine = job_fingerprint(config, models_dir)
    every = group.gather(mine)
    first = every[0]
    for rank, theirs in enumerate(every[1:], start=1):
        for field, value in first.items():
            if theirs.get(field) != value:
                raise ConfigError(
                    field,
                    f"{field}: box {group.hosts[rank]} (rank {rank}) was given another {field} than "
                    f"box {group.hosts[0]} (rank 0); every box of a job trains the same model on the "
                    "same data with the same settings",
                )


class _EventsOnly:
    """A sink that passes events on and drops metrics and checkpoints (a box other than rank 0:
    rank 0 reports the job's)."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    def log(self, metrics: dict[str, float], step: int) -> None:
        return None

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.sink.event(kind, message, data)

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        return None

    def close(self) -> None:
        self.sink.close()


def events_only(sink: Sink) -> Sink:
    """``sink`` with its metrics and checkpoints dropped, its events passed on."""
    return _EventsOnly(sink)
