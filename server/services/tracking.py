"""Where a job's trackers may write: the service's rule on top of the engine's
(``engine.tracking.uris``). A ``file:`` MLflow tracking URI must resolve inside the service's home
folder (``Settings.home``; a relative path is taken relative to it), so that no API-key holder
makes a worker write wherever its user can."""

from __future__ import annotations

import os
from pathlib import Path

from engine import ConfigError, TrainConfig
from engine.tracking import redact_url, uri_file_path, uri_problem

FIELD = "tracking.mlflow.tracking_uri"


def home_path(uri: str, *, home: Path) -> Path | None:
    """The folder a ``file:`` tracking URI names, resolved (``os.path.realpath``; a relative path
    against ``home``); None for another scheme.

    Raises:
        ConfigError: naming ``tracking.mlflow.tracking_uri``, when the folder is not inside ``home``.
    """
    path = uri_file_path(uri)
    if path is None:
        return None
    root = os.path.realpath(home)
    resolved = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, resolved]) != root:
        shown = redact_url(uri)
        message = (
            f"{FIELD}: a file: URI must name a folder inside the service's home (a relative path is "
            f"taken from there); {shown!r} is outside it"
        )
        raise ConfigError(FIELD, message, value=shown)
    return Path(resolved)


def check(config: TrainConfig, *, home: Path) -> None:
    """Refuse a config whose trackers would write outside the service's home.

    Raises:
        ConfigError: naming ``tracking.mlflow.tracking_uri`` (see ``home_path``).
    """
    if config.tracking.mlflow is not None:
        home_path(config.tracking.mlflow.tracking_uri, home=home)


def local_uri(uri: str, *, home: Path) -> str:
    """The tracking URI a worker logs to: a ``file:`` one as the absolute URI of its folder inside
    this host's home (MLflow would take a relative one against the worker's working folder);
    any other as it is.

    Raises:
        ConfigError: a ``file:`` URI outside the home (a job stored before the rule).
    """
    if uri_problem(uri) is not None:  # left for the config's validation to refuse
        return uri
    folder = home_path(uri, home=home)
    return folder.as_uri() if folder is not None else uri
