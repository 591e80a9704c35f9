"""The training methods as the service offers them: the engine's registry (``engine.methods``).

The one place the service turns a job's ``method`` section into what it needs to know: which
method, what it trains, and which data format it takes.
"""

from __future__ import annotations

from typing import Any

from engine.methods import METHODS, methods_listing


def listing() -> list[dict[str, Any]]:
    """Every method, in registry order (``GET /api/methods``)."""
    return methods_listing()


def objective_of(method: dict[str, Any]) -> str:
    """The training method of a stored or requested ``method`` section (either form)."""
    objective = method.get("objective")
    if objective in METHODS:
        return str(objective)
    kind = method.get("kind", "lora")
    return str(kind) if kind in METHODS else "sft"


def tuning_of(method: dict[str, Any]) -> str:
    """What a ``method`` section trains: ``"lora"`` or ``"full"`` (either form)."""
    if method.get("tuning") in ("lora", "full"):
        return str(method["tuning"])
    if objective_of(method) == "sft":
        kind = method.get("kind", "lora")
        return str(kind) if kind in ("lora", "full") else "lora"
    return str(method.get("dpo_tuning", "lora"))


def takes_preference_data(method: dict[str, Any]) -> bool:
    """Whether the method of a ``method`` section trains on preference rows."""
    return METHODS[objective_of(method)].data_format == "preference"
