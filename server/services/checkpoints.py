"""Checkpoints: rows written by the worker as the run saves them (each names its folder in the
store, ``runs/<job id>/checkpoints/step_000123``: ``engine.training.checkpoint_layout``); archives
built for download and kept in the store (``runs/<job id>/exports/``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine import DiskFull
from engine import training as layout
from engine.export import BuildOptions, ExportFormat
from engine.training import export_files
from server.storage import Storage, check_key
from server.tables import Checkpoint

MANIFEST = "MANIFEST.sha256"
STATE = layout.STATE_DIR  # what a Hub push leaves out beside the download's (server.hf_hub.push)
FULL = (errno.ENOSPC, errno.EDQUOT)  # a write that found no space


def run_key(path: str) -> str:
    """The key of a checkpoint a row or a worker names: a key as it is; an absolute path by the
    layout under the home folder, ``.../runs/<job id>/checkpoints/step_000123`` (what workers
    recorded before the store).

    Raises:
        ValueError: neither.
    """
    parts = PurePosixPath(path).parts
    if not PurePosixPath(path).is_absolute():
        return check_key(path)
    # runs/<job id> (``jobs.RUNS``, which imports this module) and a checkpoint's key under it
    if len(parts) > 4 and parts[-4] == "runs" and layout.run_of_key(path) is not None:
        return check_key("/".join(parts[-4:]))
    raise ValueError(f"checkpoint {path!r}: not in a job's checkpoints folder")


def _stored(storage: Storage, rows: list[Checkpoint]) -> list[Checkpoint]:
    """The rows whose checkpoint is in the store: its folder where the store is local, else an
    object under it (one listing per job folder)."""
    listed: dict[str, set[str]] = {}
    kept = []
    for row in rows:
        try:
            key = storage.key_of(row.path)
        except ValueError:  # a host path outside the store: not in it
            continue
        own = storage.local_path(key)
        if own is not None:
            if own.is_dir():
                kept.append(row)
            continue
        parent, _, name = key.rpartition("/")
        if parent not in listed:
            listed[parent] = {k[len(parent) + 1 :].split("/", 1)[0] for k, _ in storage.list(parent)}
        if name in listed[parent]:
            kept.append(row)
    return kept


def record(
    session: Session,
    *,
    job_id: str,
    step: int,
    path: str,
    kind: str,
    metrics: dict[str, Any],
    storage: Storage | None = None,
) -> None:
    """Add the checkpoint the run just saved (``path``: its key, or its folder under the home
    folder); with ``storage``, forget the ones the run pruned from it."""
    key = storage.key_of(path) if storage is not None else run_key(path)
    rows = list(session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
    kept = _stored(storage, rows) if storage is not None else rows
    for old in rows:
        if old.step == step or old not in kept:
            session.delete(old)
    session.add(Checkpoint(job_id=job_id, step=step, path=key, kind=kind, metrics=metrics))
    session.commit()


def list_for(session: Session, *, job_id: str, storage: Storage | None = None) -> list[Checkpoint]:
    """The job's checkpoints, oldest first: with ``storage``, those still in it."""
    rows = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
    return _stored(storage, list(rows)) if storage is not None else list(rows)


def get(session: Session, *, job_id: str, step: int, storage: Storage | None = None) -> Checkpoint | None:
    """The job's checkpoint at ``step``: with ``storage``, only when it is in it."""
    found = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    if found is None or storage is None:
        return found
    return found if _stored(storage, [found]) else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def export_folder(storage: Storage, key: str, *, cache: Path) -> Path:
    """A checkpoint's export (its files but the resume state) in a local folder: the store's own
    folder, or a copy pulled once into ``cache/<key>`` (into a temporary folder, renamed).

    Raises:
        FileNotFoundError: nothing is stored under ``key``.
    """
    try:
        return storage.local_copy(key, cache, folder=True, leave_out=layout.LEFT_OUT_OF_DOWNLOADS)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no checkpoint {key!r} in the store") from exc


def stored_archive(storage: Storage, key: str, *, cache: Path, build: Callable[[Path], Path]) -> Path | None:
    """The download archive ``key`` (``runs/<job id>/exports/<name>.tar``), built once and kept
    in the store: ``build(target)`` writes it to a local file (:func:`build_archive`,
    :func:`built_archive`: once, atomically), which a remote store then receives. Returns the
    local file (the store's own, or the copy in ``cache``), or None when another host built it
    and this one has no copy (serve it from the store)."""
    own = storage.local_path(key)
    target = own if own is not None else cache.joinpath(*PurePosixPath(key).parts)
    if target.is_file():
        return target
    if own is None and storage.exists(key):
        return None
    build(target)
    if own is None and not storage.exists(key):
        storage.put_file(key, target)
    return target


_building: dict[str, threading.Lock] = {}
_building_guard = threading.Lock()


@contextlib.contextmanager
def _building_lock(target: Path) -> Iterator[None]:
    """Hold the right to build ``target``: one thread of this process and one server process at a
    time (``serve --processes N``), through a lock file next to it.

    ``flock`` alone also excludes threads on a local disk (each ``open`` is its own lock holder),
    but on NFS it becomes a per-process lock; the thread lock keeps threads apart there too."""
    with _building_guard:
        lock = _building.setdefault(str(target), threading.Lock())
    with lock, open(target.with_name(f".{target.name}.lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file is closed
        yield


def build_archive(
    folder: Path, target: Path, *, readme: str | None = None, replace: dict[str, bytes] | None = None
) -> Path:
    """Write ``target`` (.tar): one top folder named like it, holding the export's files (with
    their own modification times), ``README.md`` when given (in place of the export's own), and
    ``MANIFEST.sha256`` listing the sums of all of them (``sha256sum -c MANIFEST.sha256`` inside
    the folder checks them).

    ``replace`` gives new bytes for some of the export's files (by relative path). Built once
    (parallel first requests wait for the one build) under a unique temporary name next to it and
    renamed into place, so a download never sees half a file.
    """
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _building_lock(target):
        if target.is_file():
            return target
        _write_archive(folder, target, readme=readme, replace=replace or {})
    return target


def _write_archive(folder: Path, target: Path, *, readme: str | None, replace: dict[str, bytes]) -> None:
    top = target.name.removesuffix(".tar")
    made = time.time()
    if readme is not None:  # in place of the model card peft writes
        replace = replace | {"README.md": readme.encode()}
    members: list[tuple[str, Path | bytes]] = [
        (rel, replace.get(rel, p)) for p in export_files(folder) for rel in [p.relative_to(folder).as_posix()]
    ]
    members += [(rel, data) for rel, data in replace.items() if rel not in dict(members)]
    sums = [(rel, _digest(data)) for rel, data in members]
    manifest = "".join(f"{digest}  {rel}\n" for rel, digest in sums).encode()

    def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(f"{top}/{name}")
        info.size, info.mode, info.mtime = len(data), 0o644, made
        tar.addfile(info, io.BytesIO(data))

    sizes = [len(manifest)] + [len(d) if isinstance(d, bytes) else d.stat().st_size for _, d in members]
    needed = sum(512 + -(-n // 512) * 512 for n in sizes) + 2 * tarfile.RECORDSIZE  # headers, padding
    check_space(target, needed)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with filling(target, needed), os.fdopen(fd, "wb") as out:
            with tarfile.open(fileobj=out, mode="w") as tar:
                info = tarfile.TarInfo(top)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, made
                tar.addfile(info)
                add_bytes(tar, MANIFEST, manifest)
                for rel, data in members:
                    if isinstance(data, bytes):
                        add_bytes(tar, rel, data)
                    else:
                        tar.add(data, arcname=f"{top}/{rel}", recursive=False)
            out.flush()
            os.fsync(out.fileno())  # a full disk shows here at the latest, not after the rename
        os.chmod(name, 0o644)  # mkstemp's 0600 otherwise
        os.replace(name, target)
    finally:
        Path(name).unlink(missing_ok=True)


def free_bytes(path: Path) -> int:
    """The bytes free on the disk of ``path`` (a folder that exists)."""
    return shutil.disk_usage(path).free


def check_space(target: Path, needed_bytes: int) -> None:
    """Refuse a build of ``target`` that would not fit beside it, before writing anything.

    Raises:
        DiskFull: fewer than ``needed_bytes`` are free on its disk (naming ``target``).
    """
    free = free_bytes(target.parent)
    if free < needed_bytes:
        raise DiskFull(str(target), needed_bytes=needed_bytes, free_bytes=free)


def _full(exc: BaseException, folder: Path) -> bool:
    """Whether ``exc`` is a write that found no space: an ``OSError`` saying so (here or as its
    cause), or another error (torch's and safetensors' writers raise their own) while less than
    a MiB stays free."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    loud = isinstance(exc, Exception) and not isinstance(exc, ValueError)  # a refusal stays one
    return loud and free_bytes(folder) < 1 << 20


@contextlib.contextmanager
def filling(target: Path, needed_bytes: int) -> Iterator[None]:
    """Writing the build of ``target``: a disk that fills up meanwhile becomes ``DiskFull``
    naming ``target``, the bytes it needs (at least ``needed_bytes``) and the bytes free. Leave
    the block before removing what it wrote, so the free space it reports is the real one."""
    try:
        yield
    except DiskFull as exc:  # a part of the build that knew its own size
        free = free_bytes(target.parent)
        needed = max(needed_bytes, exc.needed_bytes, free + 1)
        raise DiskFull(str(target), needed_bytes=needed, free_bytes=free) from exc
    except BaseException as exc:
        if not _full(exc, target.parent):
            raise
        free = free_bytes(target.parent)
        raise DiskFull(str(target), needed_bytes=max(needed_bytes, free + 1), free_bytes=free) from exc


def _digest(data: Path | bytes) -> str:
    return hashlib.sha256(data).hexdigest() if isinstance(data, bytes) else _sha256(data)


def built_archive(
    export: ExportFormat,
    folder: Path,
    *,
    base: Path | None,
    target: Path,
    readme: str,
    variant: str | None = None,
    system: str | None = None,
) -> Path:
    """The checkpoint's export (``folder``) built in the format ``export`` (``variant``; ``base``:
    the base model a LoRA checkpoint is merged into, when the format merges) as ``target`` (.tar):
    built once per checkpoint in a scratch folder, archived, and the scratch removed, so only
    the archive stays on disk (a merged build until :func:`clear_merged`).

    Raises:
        ValueError: the format's exporter refuses the model (e.g. a family llama.cpp cannot run).
    """
    from engine.model import model_bytes  # loads torch: not in the API's start

    top = target.name.removesuffix(".tar")

    def build(work: Path) -> None:
        options = BuildOptions(variant=variant, base=base, system=system, comment=top)
        built = export.build(folder, work / "export", options)
        _write_archive(built.folder, target, readme=readme, replace={})

    # a LoRA checkpoint merged first; the build's files, then its archive beside them
    model = model_bytes(base if base is not None else folder)
    return _built_once(target, build, needed_bytes=2 * model + 2 * _folder_bytes(folder))


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in export_files(folder))


def _built_once(target: Path, build: Callable[[Path], None], *, needed_bytes: int) -> Path:
    """``target``, built by ``build(work)`` (a scratch folder beside it, removed after) unless it
    exists: one build at a time per target, across processes.

    Raises:
        DiskFull: less than ``needed_bytes`` (the estimate of the build's scratch files and
            archive) is free beside ``target``, or the disk filled up while building; nothing
            of the build stays.
    """
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _building_lock(target):
        if target.is_file():
            return target
        check_space(target, needed_bytes)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            with filling(target, needed_bytes):
                build(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def clear_merged(target: Path, *, leftovers: tuple[Path, ...] = ()) -> int:
    """Remove a merged build: its archive, and ``leftovers`` (the merged folders older versions
    kept); the bytes freed. The next merged download builds it again."""
    with _building_lock(target):
        freed = 0
        if target.is_file():
            freed += target.stat().st_size
            target.unlink()
        for folder in leftovers:
            if folder.is_dir():
                freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                shutil.rmtree(folder, ignore_errors=True)
        return freed


def adapter_config(folder: Path, *, base_name: str) -> dict[str, bytes]:
    """``adapter_config.json`` with ``base_model_name_or_path`` set to ``base_name`` when it
    records something else (exports made before the real name was recorded: "demo", a path);
    nothing to replace otherwise. For :func:`build_archive`'s ``replace``."""
    path = folder / layout.ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("base_model_name_or_path") == base_name:
        return {}
    config["base_model_name_or_path"] = base_name
    return {layout.ADAPTER_CONFIG: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}


def readme(*, kind: str, base_name: str, top: str, step: int, job_name: str) -> str:
    """The README.md of a download: what it is and how to load it."""
    title = f"# {top}\n\nStep {step} of the Roundhouse fine-tune {job_name!r}, base model `{base_name}`.\n"
    check = "Check the files: `sha256sum -c MANIFEST.sha256` in this folder.\n"
    if kind == "adapter":
        return f"""{title}
This is a LoRA adapter (PEFT): `adapter_config.json` records the base model as
`{base_name}`, which `peft` loads by that name (from the Hugging Face Hub, or your local cache).

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{top}")
tokenizer = AutoTokenizer.from_pretrained("{top}")  # with the chat template used in training
```

With the base model in a local folder instead:

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained("path/to/{base_name.split("/")[-1]}")
model = PeftModel.from_pretrained(base, "{top}")
model = model.merge_and_unload()  # optional: a plain model, no peft at inference
```

{check}"""
    if kind == "gguf":
        return f"""{title}
For llama.cpp and Ollama: `model-*.gguf` is the model (a LoRA adapter merged into its base);
a LoRA checkpoint also has `adapter-f32.gguf`, the adapter alone for a GGUF of the base.

```bash
llama-cli -m model-*.gguf -cnv                       # llama.cpp, with the chat template inside
llama-cli -m base.gguf --lora adapter-f32.gguf -cnv  # the adapter on a GGUF of `{base_name}`
ollama create my-model -f Modelfile && ollama run my-model
```

{check}"""
    what = (
        f"This is the LoRA adapter merged into `{base_name}`: a full model folder"
        if kind == "merged"
        else f"This is a full fine-tune of `{base_name}`: a model folder"
    )
    return f"""{title}
{what} (fp32 weights, tokenizer and chat template included). It needs no `peft`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{top}")
tokenizer = AutoTokenizer.from_pretrained("{top}")
messages = [{{"role": "user", "content": "Hello"}}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
)
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))
```

{check}"""
