"""The graders that read text in this process: ``string_check`` and ``text_similarity``
(OpenAI's), and ours, ``regex``, ``json_schema`` and ``length``.

Each is built from its checked spec (``from_spec``; ``engine.graders.spec`` holds the fields and
their checks) and scores one sample at a time (``score``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from engine.graders.base import GradeFailure, LocalGrader, parse_json
from engine.graders.metrics import METRICS
from engine.graders.spec import (
    JsonSchemaSpec,
    LengthSpec,
    RegexSpec,
    StringCheckSpec,
    TextSimilaritySpec,
    schema_validator,
)
from engine.graders.templates import Template

_WORDS_AND_MARKS = re.compile(r"\w+|[^\w\s]")  # the length grader's tokens


class StringCheck(LocalGrader):
    """OpenAI's ``string_check``: 1.0 when ``input`` and ``reference`` (both templates) compare as
    ``operation`` says, else 0.0. ``eq``: equal; ``ne``: not equal; ``like``: ``input`` contains
    ``reference``; ``ilike``: the same, ignoring case."""

    type = "string_check"

    def __init__(self, name: str, input: Template, reference: Template, operation: str) -> None:
        super().__init__(name)
        self.input, self.reference, self.operation = input, reference, operation

    @classmethod
    def from_spec(
        cls, spec: StringCheckSpec, *, name: str | None = None, field: str = "grader"
    ) -> StringCheck:
        text, reference = Template.parse(spec.input), Template.parse(spec.reference)
        return cls(name or spec.name or cls.type, text, reference, spec.operation)

    def spec(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "input": self.input.source,
            "reference": self.reference.source,
            "operation": self.operation,
        }

    def score(self, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        text, reference = self.input.render(sample, item), self.reference.render(sample, item)
        if self.operation == "eq":
            return float(text == reference)
        if self.operation == "ne":
            return float(text != reference)
        if self.operation == "like":
            return float(reference in text)
        return float(reference.casefold() in text.casefold())


class TextSimilarity(LocalGrader):
    """OpenAI's ``text_similarity``: ``evaluation_metric`` of ``input`` against ``reference``
    (both templates), in [0, 1], as the package that reports it computes it (rapidfuzz, sacrebleu,
    nltk, rouge-score: ``engine.graders.metrics`` gives the settings). ``meteor`` is METEOR with
    exact and stem matches only, without WordNet synonyms."""

    type = "text_similarity"

    def __init__(self, name: str, input: Template, reference: Template, metric: str) -> None:
        super().__init__(name)
        self.input, self.reference, self.metric = input, reference, metric

    @classmethod
    def from_spec(
        cls, spec: TextSimilaritySpec, *, name: str | None = None, field: str = "grader"
    ) -> TextSimilarity:
        text, reference = Template.parse(spec.input), Template.parse(spec.reference)
        return cls(name or spec.name or cls.type, text, reference, spec.evaluation_metric)

    def spec(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "input": self.input.source,
            "reference": self.reference.source,
            "evaluation_metric": self.metric,
        }

    def score(self, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        return METRICS[self.metric](self.input.render(sample, item), self.reference.render(sample, item))


class Regex(LocalGrader):
    """Ours, ``regex``: 1.0 when ``pattern`` (Python's ``re`` syntax) is found in ``input`` (a
    template, the answer by default), or matches all of it with ``full_match``; else 0.0.
    ``ignore_case`` matches regardless of case."""

    type = "regex"

    def __init__(self, name: str, input: Template, pattern: str, full_match: bool, ignore_case: bool) -> None:
        super().__init__(name)
        self.input, self.pattern, self.full_match, self.ignore_case = input, pattern, full_match, ignore_case
        self.compiled = re.compile(pattern, re.IGNORECASE if ignore_case else 0)

    @classmethod
    def from_spec(cls, spec: RegexSpec, *, name: str | None = None, field: str = "grader") -> Regex:
        text = Template.parse(spec.input)
        return cls(name or spec.name or cls.type, text, spec.pattern, spec.full_match, spec.ignore_case)

    def spec(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "input": self.input.source,
            "pattern": self.pattern,
            "full_match": self.full_match,
            "ignore_case": self.ignore_case,
        }

    def score(self, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        text = self.input.render(sample, item)
        found = self.compiled.fullmatch(text) if self.full_match else self.compiled.search(text)
        return float(found is not None)


class JsonSchema(LocalGrader):
    """Ours, ``json_schema``: 1.0 when ``input`` (a template, the answer by default) parses as
    JSON and the value is valid against ``schema`` (a JSON Schema; its ``$schema`` picks the draft,
    2020-12 when it names none), else 0.0. Surrounding whitespace is allowed; anything else
    around the JSON (a Markdown fence) makes it not JSON."""

    type = "json_schema"

    def __init__(self, name: str, input: Template, schema: Mapping[str, Any]) -> None:
        super().__init__(name)
        self.input, self.schema = input, schema
        self.validator = schema_validator(schema)

    @classmethod
    def from_spec(cls, spec: JsonSchemaSpec, *, name: str | None = None, field: str = "grader") -> JsonSchema:
        return cls(name or spec.name or cls.type, Template.parse(spec.input), spec.json_schema)

    def spec(self) -> dict[str, Any]:
        return {"type": self.type, "name": self.name, "input": self.input.source, "schema": self.schema}

    def score(self, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        text = self.input.render(sample, item)
        value = parse_json(text)
        if value is None and text.strip() != "null":
            return 0.0
        try:
            return float(self.validator.is_valid(value))
        except RecursionError as exc:
            raise GradeFailure("the schema or the value nests too deep to check", "other") from exc
        except Exception as exc:  # an unresolvable $ref, a bad format: the grader's own fault
            raise GradeFailure(f"checking against the schema failed: {type(exc).__name__}: {exc}") from exc


class Length(LocalGrader):
    """Ours, ``length``: a score from the length of ``input`` (a template, the answer by default)
    in ``unit``s: ``characters``, or ``tokens`` (runs of letters, digits and underscores, and each
    other non-space character alone; not the model's tokenizer).

    With ``target_length``: 1.0 at the target, falling linearly to 0.0 at ``min_length`` (0 when
    not given) below it and at ``max_length`` (twice the target when not given) above it. Without:
    1.0 from ``min_length`` to ``max_length`` (either may be left out), and outside falling
    linearly to 0.0 over ``falloff`` units (0, the default: straight to 0.0).
    """

    type = "length"

    def __init__(
        self,
        name: str,
        input: Template,
        unit: str,
        min_length: int | None,
        max_length: int | None,
        target_length: int | None,
        falloff: int,
    ) -> None:
        super().__init__(name)
        self.input, self.unit = input, unit
        self.min_length, self.max_length, self.target_length = min_length, max_length, target_length
        self.falloff = falloff

    @classmethod
    def from_spec(cls, spec: LengthSpec, *, name: str | None = None, field: str = "grader") -> Length:
        return cls(
            name or spec.name or cls.type,
            Template.parse(spec.input),
            spec.unit,
            spec.min_length,
            spec.max_length,
            spec.target_length,
            spec.falloff,
        )

    def spec(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "input": self.input.source,
            "unit": self.unit,
            "min_length": self.min_length,
            "max_length": self.max_length,
            "target_length": self.target_length,
            "falloff": self.falloff,
        }

    def measure(self, text: str) -> int:
        """The length of ``text`` in the grader's unit."""
        return len(text) if self.unit == "characters" else len(_WORDS_AND_MARKS.findall(text))

    def score(self, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        length = self.measure(self.input.render(sample, item))
        if self.target_length is not None:
            target = self.target_length
            if length <= target:
                low = self.min_length or 0
                if length == target:
                    return 1.0
                return 0.0 if length <= low else (length - low) / (target - low)
            high = self.max_length if self.max_length is not None else 2 * target
            return 0.0 if length >= high else (high - length) / (high - target)
        below = (self.min_length - length) if self.min_length is not None else 0
        above = (length - self.max_length) if self.max_length is not None else 0
        outside = max(below, above, 0)
        if outside == 0:
            return 1.0
        return max(0.0, 1 - outside / self.falloff) if self.falloff else 0.0
