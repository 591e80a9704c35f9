"""The training methods as the service offers them: the engine's registry (``engine.methods``).

The one place the service turns a job's ``method`` section into what it needs to know: which
method, what it trains, and which data format it takes.
"""

from __future__ import annotations

from typing import Any

from engine.methods import METHODS, methods_listing

# the row formats that are a method's data format of their own; every other one is supervised
DATA_FORMATS = ("preference", "prompts")


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


def data_format_of(method: dict[str, Any]) -> str:
    """The rows the method of a ``method`` section trains on (its registry entry's
    ``data_format``): ``"supervised"``, ``"preference"`` or ``"prompts"``."""
    return METHODS[objective_of(method)].data_format


def dataset_kind(dataset_format: str) -> str:
    """The ``data_format`` a dataset of this row format suits: ``"preference"`` pairs,
    ``"prompts"`` (a prompt and the fields a grader reads), else ``"supervised"`` (chat,
    instruction, prompt/completion, text)."""
    return dataset_format if dataset_format in DATA_FORMATS else "supervised"


def fits(dataset_format: str, method: dict[str, Any]) -> bool:
    """Whether a dataset of row format ``dataset_format`` suits the method of a ``method`` section."""
    return dataset_kind(dataset_format) == data_format_of(method)


def methods_for(data_format: str) -> list[str]:
    """The registered methods that train on rows of ``data_format``, in registry order."""
    return [name for name, entry in METHODS.items() if entry.data_format == data_format]
