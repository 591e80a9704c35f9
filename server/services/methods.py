"""The training methods as the service offers them: the engine's registry (``engine.methods``).

The one place the service turns a job's ``method`` section into what it needs to know: which
method, what it trains, and which data format it takes.
"""

from __future__ import annotations

from typing import Any

from engine import ConfigError
from engine.data import family_of
from engine.methods import DEFAULT_OBJECTIVE, METHODS, TUNINGS, methods_listing, upgrade


def listing() -> list[dict[str, Any]]:
    """Every method, in registry order (``GET /api/methods``)."""
    return methods_listing()


def _upgraded(method: dict[str, Any]) -> dict[str, Any]:
    try:
        out = upgrade(method)
    except ConfigError:  # contradicting forms: the objective the section names first
        out = {k: v for k, v in method.items() if k not in ("kind", "dpo_tuning")}
    return out if isinstance(out, dict) else {}


def objective_of(method: dict[str, Any]) -> str:
    """The training method of a stored or requested ``method`` section (either form)."""
    objective = _upgraded(method).get("objective", DEFAULT_OBJECTIVE)
    return str(objective) if objective in METHODS else DEFAULT_OBJECTIVE


def tuning_of(method: dict[str, Any]) -> str:
    """What a ``method`` section trains: ``"lora"`` or ``"full"`` (either form)."""
    tuning = _upgraded(method).get("tuning")
    return str(tuning) if tuning in TUNINGS else "lora"


def data_format_of(method: dict[str, Any]) -> str:
    """The rows the method of a ``method`` section trains on (its registry entry's
    ``data_format``): ``"supervised"``, ``"preference"`` or ``"prompts"``."""
    return METHODS[objective_of(method)].data_format


def dataset_kind(dataset_format: str) -> str:
    """The ``data_format`` a dataset of this row format suits: its format's family
    (``engine.data.formats``); an unknown format's rows are taken as supervised."""
    try:
        return family_of(dataset_format)
    except ValueError:
        return "supervised"


def fits(dataset_format: str, method: dict[str, Any]) -> bool:
    """Whether a dataset of row format ``dataset_format`` suits the method of a ``method`` section."""
    return dataset_kind(dataset_format) == data_format_of(method)


def methods_for(data_format: str) -> list[str]:
    """The registered methods that train on rows of ``data_format``, in registry order."""
    return [name for name, entry in METHODS.items() if entry.data_format == data_format]
