"""The training methods: one package per method, found here; no torch import.

A method is a package ``engine.methods.<name>`` whose ``__init__`` defines ``METHOD``, an
``engine.methods.contract.Method``: its options (a pydantic model), its refusals, its data format,
its metrics and charts. Its ``train`` module holds the torch side. Adding a method is adding such
a package: this registry finds it, and the run configuration (``method``: a union of every
method's options, told apart by ``objective``), the run loop (``engine.training.run``), the
planner, the service's API schema, ``GET /api/methods`` and the web form read it from here.

``engine.methods.legacy`` turns the earlier shapes of a ``method`` section into today's, in one
place, before validation.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated, Any, Union

from pydantic import BeforeValidator, Discriminator, Tag

from engine.errors import ConfigError
from engine.methods.contract import TUNINGS, Method, MethodOptions
from engine.methods.legacy import DEFAULT_OBJECTIVE, upgrade
from engine.optimizers import choices

__all__ = [
    "DEFAULT_OBJECTIVE",
    "METHODS",
    "OBJECTIVES",
    "TUNINGS",
    "Method",
    "MethodOptions",
    "MethodSpec",
    "method_entry",
    "method_names",
    "methods_for",
    "methods_listing",
    "preference_methods",
    "upgrade",
]


def _discover() -> dict[str, Method]:
    found: list[Method] = []
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg:
            continue
        method = getattr(importlib.import_module(f"{__name__}.{info.name}"), "METHOD", None)
        if isinstance(method, Method):
            if method.name != info.name:
                raise RuntimeError(f"engine.methods.{info.name} defines the method {method.name!r}")
            found.append(method)
    return {m.name: m for m in sorted(found, key=lambda m: (m.order, m.name))}


METHODS: dict[str, Method] = _discover()
OBJECTIVES = tuple(METHODS)


def _objective(raw: Any) -> str:
    """The union's tag: the ``objective`` of a section (upgraded already) or of its options."""
    if isinstance(raw, MethodOptions):
        return raw.objective
    if isinstance(raw, dict):
        return str(raw.get("objective", DEFAULT_OBJECTIVE))
    return DEFAULT_OBJECTIVE


def _upgrade(raw: Any) -> Any:
    """A section in today's shape (``engine.methods.legacy``), its method a registered one."""
    out = upgrade(raw)
    if isinstance(out, dict) and out.get("objective", DEFAULT_OBJECTIVE) not in METHODS:
        if "objective" not in raw and "kind" in raw:  # the one-word form: what trains, or the method
            field, names = "kind", (*TUNINGS, *(n for n in METHODS if n != DEFAULT_OBJECTIVE))
        else:
            field, names = "objective", method_names()
        raise ConfigError(field, f"method.{field}={raw[field]!r}: must be {choices(names)}", value=raw[field])
    return out


def _options_union() -> Any:
    choices_ = tuple(Annotated[m.options, Tag(m.name)] for m in METHODS.values())
    return Annotated[Union[choices_], Discriminator(_objective), BeforeValidator(_upgrade)]  # noqa: UP007


# the ``method`` section of a run: the options of the method its ``objective`` names
MethodSpec = _options_union()


def method_names() -> tuple[str, ...]:
    """The registered method names, in registry order."""
    return OBJECTIVES


def method_entry(name: str, *, field: str = "method.objective") -> Method:
    """The registry entry of ``name``.

    Raises:
        ConfigError: ``name`` is not registered (names the field, the value and the choices).
    """
    entry = METHODS.get(name)
    if entry is None:
        raise ConfigError(field, f"{field}={name!r}: must be {choices(method_names())}", value=name)
    return entry


def methods_listing() -> list[dict[str, Any]]:
    """Every method as JSON, in registry order (``GET /api/methods``)."""
    return [m.listing() for m in METHODS.values()]


def methods_for(data_format: str) -> list[str]:
    """The registered methods that train on rows of ``data_format``, in registry order."""
    return [name for name, m in METHODS.items() if m.data_format == data_format]


def preference_methods() -> tuple[str, ...]:
    """The methods that train on preference rows."""
    return tuple(methods_for("preference"))
