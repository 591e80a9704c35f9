"""Graders: what scores a model's answers for reinforcement fine-tuning (and for trying a grader
out through the service's ``/v1/fine_tuning/alpha/graders``).

``validate_grader(spec)`` reads a grader's JSON object, OpenAI's shapes where OpenAI has the
grader, and refuses a bad one with a ``ConfigError`` naming the field
(``grader.graders.b.operation: must be one of eq, ne, like, ilike (got 'equals')``)::

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
field, a non-number) scores 0 and ``GradeResult.errors`` says why. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ConfigError
from engine.graders.base import Fields, Grader, GradeResult, make_sample
from engine.graders.multi import MultiGrader
from engine.graders.python import PythonGrader
from engine.graders.text import JsonSchema, Length, Regex, StringCheck, TextSimilarity

__all__ = ["GRADER_TYPES", "GradeResult", "Grader", "make_sample", "validate_grader"]

# type -> class; a ``multi`` grader's sub-graders may be any of them, ``multi`` included
GRADER_TYPES: dict[str, type[Grader]] = {
    "string_check": StringCheck,
    "text_similarity": TextSimilarity,
    "regex": Regex,
    "json_schema": JsonSchema,
    "length": Length,
    "python": PythonGrader,
    "multi": MultiGrader,
}
MAX_DEPTH = 4  # multi graders inside multi graders


def validate_grader(spec: dict[str, Any], field: str = "grader") -> Grader:
    """The grader ``spec`` describes, checked; ``field`` is its name in error messages.

    A ``python`` grader's source is run once in a child process to find its ``grade`` function.
    The caller closes the grader (``close()``, or ``with``) when done with it.

    Raises:
        ConfigError: a field is missing or not valid; ``.field`` is its dotted path.
    """
    return _build(spec, field, 0)


def _build(spec: Any, path: str, depth: int) -> Grader:
    fields = Fields(spec, path)
    kind = fields.choice("type", tuple(GRADER_TYPES))
    if kind == "multi":
        if depth >= MAX_DEPTH:
            raise fields.fail("type", f"multi graders nest at most {MAX_DEPTH} deep")
        return MultiGrader.from_fields(fields, lambda sub, at: _build(sub, at, depth + 1))
    grader: Grader = GRADER_TYPES[kind].from_fields(fields)  # type: ignore[attr-defined]
    return grader


__all__ += ["ConfigError"]
