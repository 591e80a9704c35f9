"""A checkpoint's download: a .tar of its export (or of the adapter merged into its base model, or
of a GGUF folder for llama.cpp and Ollama), built once and kept in the store beside it,
``runs/<job id>/exports/<name>.tar``.

With a remote store the export (not its resume state) is pulled into the API host's cache
(``home/cache/<key>``) to build it, and a merged build takes its base model from this host's
models, else from the store's ``models/<name>``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.services import checkpoints
from server.services.failures import Invalid
from server.settings import Settings
from server.storage import Storage, join
from server.tables import Checkpoint, Job


@dataclass(frozen=True)
class Archive:
    """A built archive: its key in the store, the file name to send it as, and its local file
    (None when another host built it and this one has no copy: send it from the store)."""

    key: str
    filename: str
    local: Path | None


def export_key(storage: Storage, job: Job, name: str) -> str:
    """The key of the job's download archive ``name``."""
    return join(storage.key_of(job.output_dir), checkpoints.EXPORTS, name)


def merged_name(job: Job, step: int) -> str:
    return f"{job.id[:8]}-step{step:06d}-merged.tar"


def gguf_name(job: Job, step: int, quant: str) -> str:
    return f"{job.id[:8]}-step{step:06d}-gguf-{quant}.tar"


def checkpoint_archive(
    *,
    job: Job,
    checkpoint: Checkpoint,
    merged: bool,
    settings: Settings,
    storage: Storage,
    gguf: str | None = None,
) -> Archive:
    """The archive of ``checkpoint`` (merged into its base model with ``merged``; as a GGUF
    folder with ``gguf``, the quantization): one top folder with a README and a SHA-256
    manifest, built on first use (blocking: run it off the event loop).

    Raises:
        Invalid: ``merged`` for a checkpoint that is not a LoRA adapter (naming ``merged``);
            ``gguf`` with ``merged``, or for a model llama.cpp cannot run (naming ``gguf``).
    """
    from engine.model.export import base_model_name

    step = checkpoint.step
    model = job.config["model"]
    base_name = base_model_name(model.get("name"), Path(model["path"]))
    kind = "gguf" if gguf else "merged" if merged else checkpoint.kind
    if merged and checkpoint.kind != "adapter":
        raise Invalid("invalid_request", "merged: only a LoRA adapter can be merged", param="merged")
    if merged and gguf:
        raise Invalid("invalid_request", "gguf: a GGUF is merged already; leave out merged", param="gguf")
    if gguf:
        name = gguf_name(job, step, gguf)
    else:
        name = merged_name(job, step) if merged else f"{job.id[:8]}-step{step:06d}-{kind}.tar"
    key = export_key(storage, job, name)
    top = name.removesuffix(".tar")
    text = checkpoints.readme(kind=kind, base_name=base_name, top=top, step=step, job_name=job.name)
    cache = settings.cache_dir

    def base_folder() -> Path:
        from engine.model.loading import resolve_model_path

        path = str(model["path"])
        stored_base = f"models/{job.base_model}"  # a base model only the store holds
        here = path == "demo" or (Path(path) / "config.json").is_file()
        if not here and storage.exists(f"{stored_base}/config.json"):
            path = str(storage.local_copy(stored_base, cache, folder=True))
        return resolve_model_path(path, settings.models_dir)

    def build(target: Path) -> Path:
        folder = checkpoints.export_folder(storage, storage.key_of(checkpoint.path), cache=cache)
        if gguf:
            base = base_folder() if checkpoint.kind == "adapter" else None
            system = _system_prompt(job, storage)
            try:
                return checkpoints.gguf_archive(
                    folder, base=base, target=target, readme=text, quant=gguf, system=system
                )
            except ValueError as exc:
                raise Invalid("invalid_request", f"gguf: {exc}", param="gguf") from exc
        if merged:
            return checkpoints.merged_archive(folder, base=base_folder(), target=target, readme=text)
        fixed = checkpoints.adapter_config(folder, base_name=base_name) if kind == "adapter" else {}
        return checkpoints.build_archive(folder, target, readme=text, replace=fixed)

    local = checkpoints.stored_archive(storage, key, cache=cache, build=build)
    return Archive(key=key, filename=name, local=local)


def _system_prompt(job: Job, storage: Storage) -> str | None:
    """The system prompt every conversation of the job's training file shares, if any."""
    from engine.export.modelfile import system_prompt_of_file

    train = (job.config.get("data") or {}).get("train")
    try:
        local = storage.local_path(storage.key_of(str(train))) if train else None
    except ValueError:
        return None
    return system_prompt_of_file(local) if local is not None else None


def clear_merged(*, job: Job, step: int, settings: Settings, storage: Storage) -> None:
    """Remove the cached merged build of the job's checkpoint at ``step``, here and in the store
    (the next merged download builds it again)."""
    key = export_key(storage, job, merged_name(job, step))
    exports = key.rsplit("/", 1)[0]
    leftover = storage.local_path(join(exports, f"step_{step:06d}-merged"))  # older versions' folder
    local = storage.local_path(key) or settings.cache_dir.joinpath(*key.split("/"))
    checkpoints.clear_merged(local, leftovers=(leftover,) if leftover is not None else ())
    storage.delete(key)
