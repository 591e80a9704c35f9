"""The worker's home as a cache of the store: a job's inputs pulled in, its checkpoints pushed out.

Rows hold storage keys (``datasets/<file>``, ``runs/<job id>``, ``runs/<job id>/checkpoints/
step_000123``). With the local folder store (keys relative to ``ROUNDHOUSE_HOME``) the worker's
home *is* the store: nothing is copied and the run writes under ``home/runs`` as always. With a
remote store (S3) the worker fetches what the job needs into its own home before training:

- its dataset files into ``home/cache/<key>``, and the images they name into
  ``home/cache/images/`` (the job's ``data.image_store``);
- its base model: a folder of the worker's own models folder or Hugging Face cache, else the
  store's ``models/<name>/`` (``roundhouse models push NAME FOLDER`` puts one there) pulled into
  ``home/cache/models/<name>``;
- the job's latest stored checkpoint into ``home/runs/<job id>/checkpoints/``, so that the run
  resumes from it (``engine.training.run.Run.resume``), whichever host wrote it;

and pushes each checkpoint the run saves before its row is recorded (a row never names a missing
object), deletes the ones the run pruned (``checkpoint.keep_last``), and pushes ``train.log``.
Rows whose paths are absolute (made before the store) are used as they are.

A store that does not answer holds a checkpoint's push up: it is tried again, whole, with
exponential backoff for up to ``PUSH_RETRY_S`` (each retry told to the caller, which records it
as a job event), and the run goes on once it is stored.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine import ConfigError
from engine import training as layout
from server.services import tracking

if TYPE_CHECKING:
    from server.settings import Settings
    from server.storage import Storage

log = logging.getLogger("roundhouse.worker")
CACHE = "cache"
LOG = "train.log"
# how long a checkpoint's push (and its row's look at the store) waits for a store that does not
# answer before the run fails; its retries wait 1 s, doubling up to 30 s
PUSH_RETRY_S = 600.0
T = TypeVar("T")


def store_retrying(
    call: Callable[[], T],
    *,
    what: str,
    on_retry: Callable[[str, float], None] | None = None,
    budget_s: float = PUSH_RETRY_S,
) -> T:
    """``call()`` (which uses the store) called again while the store is unavailable
    (``StorageUnavailable``), with exponential backoff for ``budget_s`` seconds; ``on_retry(message,
    wait_s)`` hears of each retry.

    Raises:
        StorageUnavailable: still unavailable after ``budget_s``.
    """
    from server.storage.base import retrying

    return retrying(call, what=what, budget_s=budget_s, first_s=1.0, most_s=30.0, on_retry=on_retry)


def open_store(settings: Settings) -> Storage:
    """The configured store (``ROUNDHOUSE_STORAGE_URL``; unset: the home folder itself)."""
    from server.storage import open_storage

    return open_storage(settings)


def _home_store(settings: Settings) -> Storage:
    from server.storage import LocalStorage

    return LocalStorage(settings.home)


def is_key(value: str) -> bool:
    """A store's key (relative), not a host path (absolute: rows made before the store)."""
    return not Path(value).is_absolute()


_is_key = is_key


def run_folder(settings: Settings, output_dir: str) -> Path:
    """The local folder a job's run writes to: ``home/<key>`` (the store's own folder with the local
    store, a cache folder with a remote one), or the row's absolute path."""
    return settings.home.resolve() / output_dir if _is_key(output_dir) else Path(output_dir)


def same_file(a: Path | None, b: Path) -> bool:
    return a is not None and a.resolve() == b.resolve()


def fetch_file(settings: Settings, store: Storage | None, value: str, *, field: str) -> str:
    """A dataset file as a local path: an absolute path as it is, the local store's own file, or a
    copy pulled once into ``home/cache/<key>``."""
    if not _is_key(value):
        return value
    try:
        return str((store or _home_store(settings)).local_copy(value, settings.home.resolve() / CACHE))
    except FileNotFoundError:
        raise ConfigError(field, f"{field}: {value!r} is not in the store", value=value) from None


def fetch_images(settings: Settings, store: Storage | None, data: dict[str, Any]) -> str:
    """The image store's folder here for a job's ``data`` section (``data.image_store``): a path as
    it is (the API host's own store folder, which is this host's too), else the images its
    datasets' manifests list, pulled into ``home/cache/images`` (``storage.images.folder_for``).

    Raises:
        ConfigError: (``data.image_store``) an image a dataset names is not in the store.
    """
    value = str(data["image_store"])
    if not _is_key(value):
        return value
    from server.storage import images

    keys = [str(data[f]) for f in ("train", "validation") if data.get(f) and _is_key(str(data[f]))]
    try:
        folder = images.folder_for(
            store or _home_store(settings), keys, cache=settings.home.resolve() / CACHE
        )
    except FileNotFoundError as exc:
        raise ConfigError("data.image_store", f"data.image_store: {exc}", value=value) from None
    return str(folder)


def fetch_model(settings: Settings, store: Storage | None, *, path: str, name: str) -> str:
    """The base model's folder here: the config's path when it is a model folder on this host (or
    ``demo``), else the worker's own models folder or Hugging Face cache, else the store's
    ``models/<name>/`` pulled into ``home/cache/models/<name>``.

    Raises:
        ConfigError: (``model.path``) none has it; the message says how to provide it.
    """
    from server.services import models

    if path == "demo" or (Path(path) / "config.json").is_file():
        return path
    found = models.usable_folder(name, settings.models_dir, settings.hf_cache_dir)
    if found is not None:
        return str(found)
    prefix = f"models/{name}"
    if store is not None and store.exists(f"{prefix}/config.json"):
        return str(store.materialize(prefix, settings.home.resolve() / CACHE))
    message = (
        f"base model {name!r} is not on host {settings.host_name}: put its folder in"
        f" {settings.models_dir / name} there, or push it to the store once with"
        f" `roundhouse models push {name} FOLDER`"
    )
    raise ConfigError("model.path", message, value=path)


def local_config(
    settings: Settings,
    store: Storage | None,
    *,
    config: dict[str, Any],
    base_model: str,
    output_dir: str | None = None,
) -> dict[str, Any]:
    """The job's TrainConfig (as stored: keys, or the API host's paths with the local store) with
    the local paths this host trains with; the run folder is ``run_folder`` of ``output_dir`` (the
    job row's key; default: the config's); a ``file:`` MLflow tracking URI as its folder in this
    host's home (``services.tracking.local_uri``; a ``ConfigError`` outside it)."""
    raw = dict(config)
    data = dict(raw.get("data") or {})
    if data.get("image_store"):  # from the dataset keys, before they become local paths
        data["image_store"] = fetch_images(settings, store, data)
    data["train"] = fetch_file(settings, store, str(data["train"]), field="data.train")
    if data.get("validation"):
        data["validation"] = fetch_file(settings, store, str(data["validation"]), field="data.validation")
    model = dict(raw.get("model") or {})
    model["path"] = fetch_model(settings, store, path=str(model.get("path", "demo")), name=base_model)
    folder = run_folder(settings, output_dir or str(raw["output_dir"]))
    raw.update(data=data, model=model, output_dir=str(folder))
    mlflow = (raw.get("tracking") or {}).get("mlflow")
    if mlflow and isinstance(mlflow.get("tracking_uri"), str):  # a file: one in this host's home
        uri = tracking.local_uri(mlflow["tracking_uri"], home=settings.home)
        raw["tracking"] = {**raw["tracking"], "mlflow": {**mlflow, "tracking_uri": uri}}
    return raw


def pull_checkpoint(
    store: Storage | None, *, key: str | None, folder: Path, output_dir: str | None = None
) -> bool:
    """Bring the job's latest stored checkpoint ``key`` into ``folder/checkpoints/`` unless it is
    there already (the local store's own folder, or this host wrote it). Returns whether it pulled.

    With a remote store and the job's key ``output_dir``, the local checkpoints newer than ``key``
    (or all, with none stored) are removed first: no row names them (a run on this host stopped
    before it pushed them, and another host went on since), so the run must not resume from them."""
    if store is None:
        return False
    checkpoints = layout.checkpoints_dir(folder)
    remote = (
        output_dir is not None and _is_key(output_dir) and not same_file(store.local_path(output_dir), folder)
    )
    if remote and checkpoints.is_dir():
        newest = layout.parse_step(key) if key is not None else None
        for old in checkpoints.iterdir():
            step = layout.parse_step(old.name)
            if step is not None and step > (-1 if newest is None else newest):
                shutil.rmtree(old, ignore_errors=True)
    if key is None or not _is_key(key):
        return False
    target = checkpoints / Path(key).name
    if layout.is_complete(target) or same_file(store.local_path(key), target):
        return False
    store.get_tree(key, target)  # atomic: a complete folder or none
    return True


def push_checkpoint(
    store: Storage | None,
    *,
    output_dir: str,
    path: Path,
    keep_last: int,
    on_retry: Callable[[str, float], None] | None = None,
    budget_s: float = PUSH_RETRY_S,
) -> str:
    """Put a checkpoint the run just saved in the store, then delete the stored ones the run's
    ``keep_last`` drops (counting those other hosts stored). Returns the row's path: the key.

    While the store is unavailable the whole push is tried again (``store_retrying``: ``on_retry``,
    ``budget_s``); it returns only once every file of the checkpoint is stored.

    Raises:
        StorageUnavailable: the store stayed unavailable for ``budget_s``.
    """
    if not _is_key(output_dir):
        return str(path)
    root = layout.checkpoints_key(output_dir)
    key = f"{root}/{path.name}"
    if store is None or same_file(store.local_path(key), path):
        return key
    what = f"pushing checkpoint {path.name}"
    return store_retrying(
        lambda: _push(store, root=root, key=key, path=path, keep_last=keep_last),
        what=what,
        on_retry=on_retry,
        budget_s=budget_s,
    )


def _push(store: Storage, *, root: str, key: str, path: Path, keep_last: int) -> str:
    """One try of ``push_checkpoint`` (all of it may be done again: each step is idempotent)."""
    store.put_tree(key, path)
    names = {k[len(root) + 1 :].split("/", 1)[0] for k, _ in store.list(root)}
    stored = {step for name in names if (step := layout.parse_step(name)) is not None}
    here = {step for p in path.parent.iterdir() if (step := layout.parse_step(p.name)) is not None}
    for step in layout.pruned_steps(stored | here, keep_last):
        if step in stored:
            store.delete_prefix(f"{root}/{layout.step_name(step)}")
    return key


def push_log(store: Storage | None, *, output_dir: str, folder: Path) -> None:
    """Put the run's ``train.log`` in the store (a remote one: the local store holds it already)."""
    source = folder / LOG
    key = f"{output_dir}/{LOG}"
    if (
        store is None
        or not _is_key(output_dir)
        or not source.is_file()
        or same_file(store.local_path(key), source)
    ):
        return
    store.put_file(key, source)
