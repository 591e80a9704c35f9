"""The model a chat or completion request names: a base model, a fine-tuned model (``ft:...``), a
checkpoint (``ft:...:ckpt-step-N``, or a job id and step), resolved to the folders the worker's
inference service loads (``server/worker/inference.py``), with the base model's parameter count
(where it runs depends on it). Nothing here loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from server.services import checkpoints, fine_tuned, jobs, models
from server.storage import Storage


class NotFound(LookupError):
    """No such model, job or checkpoint; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Refused(ValueError):
    """A model that cannot be served (the engine does not support it); ``param`` names the field."""

    def __init__(self, code: str, param: str, message: str) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True)
class Target:
    """What to load: a model folder (or ``demo``), optionally with a LoRA adapter folder on it."""

    name: str  # as the request named it, for messages
    model: str
    adapter: str | None
    models_dir: Path
    parameters: int = 0  # the base model's (an estimate where its files have no header to count)

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.model, self.adapter)


def _parameters(info: models.BaseModelInfo) -> int:
    # no safetensors header to count from: the size of the files as 2-byte weights (an overestimate
    # for fp32 files: a model is kept off the CPU rather than put there when in doubt)
    return info.parameters if info.parameters is not None else info.size_bytes // 2


def base_target(*, name: str, models_dir: Path, hf_cache: Path | None) -> Target:
    """A base model from ``GET /api/models`` by name.

    Raises:
        NotFound: (``model``) no such model.
        Refused: (``model``) the engine does not support it.
    """
    info = models.find(name, models_dir, hf_cache)
    if info is None:
        raise NotFound("model", f"no base model {name!r} (see GET /api/models)")
    if not info.supported:
        raise Refused("unsupported_model", "model", f"base model {name!r}: {info.unsupported_reason}")
    model = str(info.path) if info.path is not None and info.ready else name  # "demo": prepared on load
    return Target(name, model, None, models_dir, _parameters(info))


def checkpoint_target(
    session: Session,
    *,
    job_id: str,
    step: int,
    models_dir: Path,
    hf_cache: Path | None,
    storage: Storage,
    cache: Path,
) -> Target:
    """A job's checkpoint: a full model folder, or a LoRA adapter on the job's base model. Its
    export is read where the store keeps it (a local store), or pulled once into ``cache``.

    Raises:
        NotFound: (``checkpoint.job_id``, ``checkpoint.step``) no such job or checkpoint on disk;
            (``checkpoint``) the adapter's base model is gone.
        Refused: (``checkpoint``) its base model is unsupported.
    """
    job = jobs.get_job(session, job_id=job_id)
    if job is None:
        raise NotFound("checkpoint.job_id", f"no job {job_id!r}")
    found = checkpoints.get(session, job_id=job.id, step=step, storage=storage)
    if found is None:
        raise NotFound("checkpoint.step", f"job {job.id!r} has no checkpoint at step {step}")
    key = storage.key_of(found.path)
    name = f"job {job.id[:8]} step {step}"
    info = models.find(job.base_model, models_dir, hf_cache)
    if info is not None and not info.supported:
        raise Refused("unsupported_model", "checkpoint", f"{name}: {info.unsupported_reason}")
    if info is not None:
        parameters = _parameters(info)
    else:  # its base is gone; the export's own weights are fp32
        weights = [
            s for k, s in storage.list(key) if "/" not in k[len(key) + 1 :] and k.endswith(".safetensors")
        ]
        parameters = sum(weights) // 4
    if found.kind != "adapter":
        export = str(checkpoints.export_folder(storage, key, cache=cache))
        return Target(name, export, None, models_dir, parameters)
    base = str((job.config.get("model") or {}).get("path") or "")
    if base != "demo" and not (Path(base) / "config.json").is_file():
        raise NotFound("checkpoint", f"{name} is a LoRA adapter on {job.base_model!r}, which is gone")
    adapter = str(checkpoints.export_folder(storage, key, cache=cache))
    return Target(name, base, adapter, models_dir, parameters)


def fine_tuned_target(
    session: Session,
    *,
    name: str,
    models_dir: Path,
    hf_cache: Path | None,
    storage: Storage,
    cache: Path,
) -> Target | None:
    """A fine-tuned model or checkpoint by the name the OpenAI-compatible API gives it
    (``ft:<base>:<suffix>:<job id>[:ckpt-step-<step>]``, the job's latest checkpoint without a
    step); None for a name that is not one (a base model's).

    Raises:
        NotFound, Refused: (``model``) as :func:`checkpoint_target`, or no such job or checkpoint.
    """
    if fine_tuned.parse_model(name) is None:
        return None
    try:
        job, found = fine_tuned.resolve_model(session, name=name, storage=storage)
        target = checkpoint_target(
            session,
            job_id=job.id,
            step=found.step,
            models_dir=models_dir,
            hf_cache=hf_cache,
            storage=storage,
            cache=cache,
        )
    except LookupError as exc:  # NotFound too
        raise NotFound("model", str(exc)) from exc
    except Refused as exc:
        raise Refused(exc.code, "model", str(exc)) from exc
    return Target(name, target.model, target.adapter, target.models_dir, target.parameters)
