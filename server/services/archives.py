"""A checkpoint's download: a .tar of its export in one of the export formats
(``engine.export.formats``: its own files, the adapter merged into its base model, a GGUF folder
for llama.cpp and Ollama), built once and kept in the store beside it,
``runs/<job id>/exports/<name>.tar``.

With a remote store the export (not its resume state) is pulled into the API host's cache
(``home/cache/<key>``) to build it, and a merged build takes its base model from this host's
models, else from the store's ``models/<name>``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine import training as layout
from engine.export import CHECKPOINT, FORMATS, GGUF, MERGED, ExportFormat, FormatInfo
from engine.vision import PROCESSOR_FILES, vision_spec
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
    return join(storage.key_of(job.output_dir), layout.EXPORTS_DIR, name)


def archive_name(job: Job, step: int, tag: str) -> str:
    """The file name of a download (``ExportFormat.tag``: ``adapter``, ``merged``, ``gguf-q8_0``)."""
    return f"{job.id[:8]}-step{step:06d}-{tag}.tar"


@dataclass(frozen=True)
class ExportChoice:
    """The format a download asks for, its variant, and the request's field that chose it (what
    a refusal names)."""

    export: ExportFormat
    variant: str | None = None
    param: str = "format"


def choose(
    *, format: str | None = None, variant: str | None = None, merged: bool = False, gguf: str | None = None
) -> ExportChoice:
    """The export a download asks for: ``format`` and ``variant``, or the older shorthands
    ``merged=true`` (``format=merged``) and ``gguf=QUANT`` (``format=gguf&variant=QUANT``).

    Raises:
        Invalid: more than one of them, or a variant beside ``gguf``.
    """
    if merged and gguf:
        raise Invalid("invalid_request", "gguf: a GGUF is merged already; leave out merged", param="gguf")
    if (merged or gguf) and format is not None:
        param = "merged" if merged else "gguf"
        raise Invalid("invalid_request", f"{param}: give format or {param}, not both", param=param)
    if gguf:
        if variant is not None and variant != gguf:
            raise Invalid(
                "invalid_request", f"variant: gguf={gguf} names the variant already", param="variant"
            )
        return ExportChoice(GGUF, gguf, "gguf")
    if merged:
        return ExportChoice(MERGED, variant, "merged")
    return ExportChoice(FORMATS[format] if format is not None else CHECKPOINT, variant)


def formats_for(job: Job) -> list[FormatInfo]:
    """Every export format, each saying why the job's checkpoints cannot be exported so: a GGUF of
    a family it cannot write, when the base model's config is on this host (a format for LoRA
    checkpoints only says so in ``adapter_only``; each checkpoint has its kind)."""
    found = architecture(job)
    return [f.info(refused=f.refusal(kind=None, architecture=found)) for f in FORMATS.values()]


def architecture(job: Job) -> str | None:
    """The base model's architecture (``config.json``), when its folder is on this host."""
    try:
        config = json.loads((Path(str(job.config["model"]["path"])) / "config.json").read_text())
        return str(config["architectures"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def checkpoint_archive(
    *, job: Job, checkpoint: Checkpoint, choice: ExportChoice, settings: Settings, storage: Storage
) -> Archive:
    """The archive of ``checkpoint`` in the format ``choice`` asks for (and its variant, e.g. a
    GGUF quantization): one top folder with a README and a SHA-256 manifest, built on first use
    (blocking: run it off the event loop).

    Raises:
        Invalid: (naming the request's field that chose the format) a format the checkpoint
            cannot take (``merged`` of a full checkpoint), a variant the format lacks, a model
            the format's exporter refuses (a GGUF of a family llama.cpp cannot run, of a
            vision-language model), before anything is built.
    """
    from engine.model import base_model_name

    export, param = choice.export, choice.param
    step = checkpoint.step
    model = job.config["model"]
    base_name = base_model_name(model.get("name"), Path(model["path"]))
    variant = checked_variant(choice, kind=checkpoint.kind, architecture=architecture(job))
    name = archive_name(job, step, export.tag(checkpoint.kind, variant))
    key = export_key(storage, job, name)
    top = name.removesuffix(".tar")
    what = export.what(checkpoint.kind)
    text = checkpoints.readme(kind=what, base_name=base_name, top=top, step=step, job_name=job.name)
    cache = settings.cache_dir

    def build(target: Path) -> Path:
        folder = checkpoints.export_folder(storage, storage.key_of(checkpoint.path), cache=cache)
        if export is CHECKPOINT:  # the checkpoint's own files, archived from where they are
            fixed = checkpoints.adapter_config(folder, base_name=base_name) if what == "adapter" else {}
            fixed |= processor_files(job, folder, settings=settings, storage=storage)
            return checkpoints.build_archive(folder, target, readme=text, replace=fixed)
        base = (
            base_folder(job, settings=settings, storage=storage)
            if export.needs_base(checkpoint.kind)
            else None
        )
        system = system_prompt(job, storage)
        try:
            return checkpoints.built_archive(
                export, folder, base=base, target=target, readme=text, variant=variant, system=system
            )
        except ValueError as exc:
            raise Invalid("invalid_request", f"{param}: {exc}", param=param) from exc

    local = checkpoints.stored_archive(storage, key, cache=cache, build=build)
    return Archive(key=key, filename=name, local=local)


def checked_variant(choice: ExportChoice, *, kind: str, architecture: str | None = None) -> str | None:
    """The variant an export of a checkpoint of ``kind`` (whose base model is ``architecture``,
    when known) uses: the one asked for, else the format's default.

    Raises:
        Invalid: the format refuses the checkpoint (``merged`` of a full checkpoint, a GGUF of a
            family it cannot write), naming the request's field that chose the format; a variant
            the format lacks (``variant``).
    """
    reason = choice.export.refusal(kind=kind, architecture=architecture)
    if reason is not None:
        raise Invalid("invalid_request", f"{choice.param}: {reason}", param=choice.param)
    try:
        return choice.export.variant_of(choice.variant)
    except ValueError as exc:
        raise Invalid("invalid_request", str(exc), param="variant") from exc


def processor_files(job: Job, folder: Path, *, settings: Settings, storage: Storage) -> dict[str, bytes]:
    """A vision-language model's processor files (``PROCESSOR_FILES``) that its base model's
    folder has and the checkpoint's export ``folder`` lacks (a checkpoint written without
    them), by name: what its download and its push add, so that either runs on images. Empty
    for a text model."""
    if vision_spec(architecture(job)) is None:
        return {}
    missing = [name for name in PROCESSOR_FILES if not (folder / name).is_file()]
    if not missing:
        return {}
    base = Path(base_path(job, settings=settings, storage=storage))
    return {name: (base / name).read_bytes() for name in missing if (base / name).is_file()}


def base_path(job: Job, *, settings: Settings, storage: Storage) -> str:
    """The job's base model as a merge takes it (``model.path``, ``demo`` as it is): this host's
    folder, else the store's copy pulled into the cache (a base model only the store holds)."""
    path = str(job.config["model"]["path"])
    stored_base = f"models/{job.base_model}"
    here = path == "demo" or (Path(path) / "config.json").is_file()
    if not here and storage.exists(f"{stored_base}/config.json"):
        path = str(storage.local_copy(stored_base, settings.cache_dir, folder=True))
    return path


def base_folder(job: Job, *, settings: Settings, storage: Storage) -> Path:
    """The folder of the job's base model (:func:`base_path`; the demo model prepared on first use)."""
    from engine.model import resolve_model_path

    return resolve_model_path(base_path(job, settings=settings, storage=storage), settings.models_dir)


def system_prompt(job: Job, storage: Storage) -> str | None:
    """The system prompt every conversation of the job's training file shares, if any."""
    from engine.export import system_prompt_of_file

    train = (job.config.get("data") or {}).get("train")
    try:
        local = storage.local_path(storage.key_of(str(train))) if train else None
    except ValueError:
        return None
    return system_prompt_of_file(local) if local is not None else None


def clear_merged(*, job: Job, step: int, settings: Settings, storage: Storage) -> None:
    """Remove the cached merged build of the job's checkpoint at ``step``, here and in the store
    (the next merged download builds it again)."""
    key = export_key(storage, job, archive_name(job, step, MERGED.tag(layout.CheckpointKind.ADAPTER, None)))
    exports = key.rsplit("/", 1)[0]
    leftover = storage.local_path(join(exports, f"{layout.step_name(step)}-merged"))  # older versions' folder
    local = storage.local_path(key) or settings.cache_dir.joinpath(*key.split("/"))
    checkpoints.clear_merged(local, leftovers=(leftover,) if leftover is not None else ())
    storage.delete(key)
