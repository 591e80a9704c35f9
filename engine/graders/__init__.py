"""Graders: what scores a model's answers for reinforcement fine-tuning (and for trying a grader
out through the service's ``/v1/fine_tuning/alpha/graders``).

A grader's JSON object is a ``GraderSpec`` (``engine.graders.spec``: a pydantic union on
``type``, OpenAI's shapes where OpenAI has the grader). ``validate_grader(spec)`` checks one and
builds its grader, refusing a bad one with a ``ConfigError`` naming the field
(``grader.graders.b.operation: Input should be 'eq', 'ne', 'like' or 'ilike' (got "equals")``)::

    grader = validate_grader({"type": "string_check", "name": "exact", "operation": "eq",
                              "input": "{{sample.output_text}}", "reference": "{{item.answer}}"})
    result = grader.grade_batch(["4", "five"], [{"answer": "4"}, {"answer": "5"}])
    result.rewards  # [1.0, 0.0]
    grader.close()

The types: ``string_check``, ``text_similarity``, ``multi`` and ``python`` (OpenAI's), and
``regex``, ``json_schema`` and ``length`` (ours). ``input`` and ``reference`` are templates
(``{{sample.output_text}}``, ``{{item.<field>}}``: ``engine.graders.templates``). A sample is
``{"output_text", "output_json", "choices"}`` (``make_sample``), an item the dataset row.

A grader never raises for a sample: one it cannot grade (a crash, a timeout, a missing item
field, a non-number) scores 0 and ``GradeResult.errors`` says why. A ``python`` grader's child
runs under the confinement this box gives (``engine.graders.sandbox``: ``detect_confinement()``;
``confinement_refusal`` says why python graders are refused where it is too weak, unless
``UNCONFINED_SETTING`` allows them). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

from engine.errors import ConfigError
from engine.graders.base import GRADERS, Grader, GradeResult, build, make_sample
from engine.graders.fields import OWN_ERRORS
from engine.graders.multi import MultiGrader
from engine.graders.python import PythonGrader
from engine.graders.sandbox import UNCONFINED_SETTING, Confinement
from engine.graders.sandbox import detect as detect_confinement
from engine.graders.sandbox import refusal as confinement_refusal
from engine.graders.spec import GRADER_SPECS, GraderJson, GraderSpec, as_given
from engine.graders.text import JsonSchema, Length, Regex, StringCheck, TextSimilarity

__all__ = [
    "GRADER_TYPES",
    "UNCONFINED_SETTING",
    "ConfigError",
    "Confinement",
    "GradeResult",
    "Grader",
    "GraderJson",
    "GraderSpec",
    "JsonSchema",
    "Length",
    "MultiGrader",
    "PythonGrader",
    "Regex",
    "StringCheck",
    "TextSimilarity",
    "as_given",
    "confinement_refusal",
    "detect_confinement",
    "make_sample",
    "parse_grader",
    "validate_grader",
]

# type -> class; a ``multi`` grader's sub-graders may be any of them, ``multi`` included
GRADER_TYPES: dict[str, type[Grader]] = {kind: GRADERS[kind] for kind in GRADER_SPECS}


@functools.cache
def _spec_adapter() -> TypeAdapter[GraderSpec]:
    """The union's validator, built on first use (importing the graders builds no schema)."""
    return TypeAdapter(GraderSpec)


def parse_grader(spec: Any, field: str = "grader") -> GraderSpec:
    """The grader ``spec`` describes (its JSON object, or a spec), checked as ``GraderSpec``;
    ``field`` is its name in error messages. Nothing is run.

    Raises:
        ConfigError: a field is missing or not valid; ``.field`` is the first one's dotted path,
            the message lists each (``grader.graders.b.operation: Input should be ... (got "x")``).
    """
    try:
        return _spec_adapter().validate_python(spec)
    except ValidationError as exc:
        errors = exc.errors()
        lines = []
        for error in errors:
            shown = error["input"]
            got = (
                f" (got {json.dumps(shown)})"
                if isinstance(shown, str | int | float | bool)
                and not error["type"].startswith(OWN_ERRORS)
                and error["type"] != "missing"
                else ""
            )
            lines.append(f"{_path(field, error['loc'])}: {error['msg']}{got}")
        first = errors[0]
        raise ConfigError(_path(field, first["loc"]), "; ".join(lines), value=first["input"]) from None


def validate_grader(spec: Any, field: str = "grader") -> Grader:
    """The grader ``spec`` describes (its JSON object, or a spec), checked; ``field`` is its name in
    error messages.

    A ``python`` grader's source is run once in a child process to find its ``grade`` function.
    The caller closes the grader (``close()``, or ``with``) when done with it.

    Raises:
        ConfigError: a field is missing or not valid; ``.field`` is its dotted path.
    """
    return build(parse_grader(spec, field), field=field)


def _path(field: str, loc: tuple[str | int, ...]) -> str:
    return ".".join([field, *(str(p) for p in loc)])
