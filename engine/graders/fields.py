"""What the grader specs (``engine.graders.spec``) are made of: the limits, the field types
(``Text``, ``Name``, ``TemplateText``, ``Bound``), the ``Spec`` base, and the refusals of a check
(``refusal``, ``refused_at``: errors whose messages say all, located at their field)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    StrictInt,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, InitErrorDetails, PydanticCustomError

from engine.graders.templates import Template, TemplateError

MAX_NAME = 256
MAX_TEXT = 100_000  # characters of a template, a formula or a Python grader's source
MAX_PATTERN = 2000
MAX_LENGTH = 10_000_000  # a length grader's bounds
DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S, MAX_TIMEOUT_S = 5.0, 0.01, 60.0
DEFAULT_MEMORY_MB, MIN_MEMORY_MB, MAX_MEMORY_MB = 1024, 128, 16384
OUTPUT_TEXT = "{{sample.output_text}}"
KIND = "the grader's kind"  # every spec's type field
# the error types raised here, whose messages say all (the others get the value given appended)
OWN_ERRORS = "grader_"
_ONE_LINE = re.compile(r"^[^\x00-\x1f\x7f]+$")


def refusal(kind: str, message: str) -> PydanticCustomError:
    """A check's error: ``kind`` names it (``grader_<kind>``), ``message`` says all."""
    return PydanticCustomError(OWN_ERRORS + kind, message)


def refused_at(loc: tuple[str | int, ...], kind: str, message: str, value: Any) -> ValidationError:
    """A check's error located at ``loc`` below the value being validated (a model's field)."""
    detail = InitErrorDetails(type=refusal(kind, message), loc=loc, input=value)
    return ValidationError.from_exception_data("grader", [detail])


def unicode_text(value: str) -> str:
    """``value``, refused when it holds a lone surrogate (JSON can carry one, no answer could)."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise refusal("unicode", "must be Unicode text (it holds a lone surrogate)") from None
    return value


def _one_line(value: str) -> str:
    if not _ONE_LINE.match(value):
        raise refusal("name", "must be one line of text, not empty, without control characters")
    return value


def _template(value: str) -> str:
    try:
        Template.parse(value)
    except TemplateError as exc:
        raise refusal("template", str(exc)) from None
    return value


Text = Annotated[str, StringConstraints(max_length=MAX_TEXT), AfterValidator(unicode_text)]
Name = Annotated[
    str, StringConstraints(max_length=MAX_NAME), AfterValidator(unicode_text), AfterValidator(_one_line)
]
TemplateText = Annotated[
    str,
    StringConstraints(max_length=MAX_TEXT),
    AfterValidator(unicode_text),
    AfterValidator(_template),
    Field(
        description="a template: text with {{sample.output_text}}, {{sample.output_json.<field>}} or "
        "{{item.<field>}} (the dataset row's field, dotted into objects, a number indexing a list)"
    ),
]
Bound = Annotated[StrictInt, Field(ge=0, le=MAX_LENGTH)]
StringOperation = Literal["eq", "ne", "like", "ilike"]
# OpenAI's names; all but cosine are computed (engine.graders.metrics)
EvaluationMetric = Literal[
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "cosine",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
]
LengthUnit = Literal["characters", "tokens"]


def null_allowed(schema: dict[str, Any]) -> None:
    """A spec's JSON schema: a field that may be left out may be null too (as validation reads it)."""
    required = set(schema.get("required", ()))
    outside = ("title", "description", "default")
    for name, field in schema.get("properties", {}).items():
        if name in required or any(choice.get("type") == "null" for choice in field.get("anyOf", ())):
            continue
        inner = {k: v for k, v in field.items() if k not in outside}
        kept = {k: v for k, v in field.items() if k in outside}
        field.clear()
        field.update({"anyOf": [inner, {"type": "null"}], **kept})


class Spec(BaseModel):
    """What every grader's object has: its ``type`` and its ``name``."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        serialize_by_alias=True,
        json_schema_mode_override="validation",  # one schema of a spec, in requests and answers
        json_schema_extra=null_allowed,
        defer_build=True,  # built on first use: importing the graders costs no schema building
    )

    type: str
    name: Name | None = Field(
        None, description="its name, one line (default: its type; in a multi grader, its key there)"
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            fields = {f.alias or name for name, f in cls.model_fields.items()}
            return {k: v for k, v in data.items() if v is not None or k not in fields}
        return data


def all_unicode(value: Any, loc: tuple[str | int, ...]) -> None:
    """Refuse a string in ``value`` (keys too) that holds a lone surrogate, at its place."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, loc)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, str):
            try:
                unicode_text(node)
            except PydanticCustomError as exc:
                raise refused_at(at, "unicode", exc.message(), node) from None
        elif isinstance(node, Mapping):
            for key, item in node.items():
                stack.append((key, at))
                stack.append((item, (*at, key) if str(key).isascii() else at))
        elif isinstance(node, list):
            stack.extend((item, (*at, i)) for i, item in enumerate(node))


@dataclass(frozen=True)
class DocumentedAs:
    """An annotation: the value validates as the type it annotates, its JSON schema is ``shown``'s."""

    shown: Any

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(TypeAdapter(self.shown).core_schema)
