"""Each grader type's JSON object as a pydantic model, and ``GraderSpec``, their union on ``type``:
the one contract of a grader, which ``validate_grader``, ``method.grader`` of a job and the
schemas of ``/docs`` and ``/v1`` all read.

OpenAI's field names and shapes where OpenAI has the grader (``string_check``,
``text_similarity``, ``python``, ``multi``), ours otherwise (``regex``, ``json_schema``,
``length``). A spec checks all that can be checked without running anything: templates, names,
lengths, choices, a pattern that compiles, a JSON Schema that is valid, a ``multi`` grader's names
and formula, ``multi`` graders nested at most ``MAX_DEPTH`` deep. (A ``python`` grader's source
runs once when the grader is built, ``Grader.from_spec``.)

An error's location names fields only: pydantic's union puts the grader's type in it
(``('graders', 'b', 'string_check', 'operation')``); here it is left out, so every validation of
a spec (a job's config, ``validate_grader``) names ``graders.b.operation``. A field given as null
counts as left out; ``as_given(spec)`` is the JSON object given (the fields set, not the defaults).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine.graders.fields import (
    DEFAULT_MEMORY_MB,
    DEFAULT_TIMEOUT_S,
    KIND,
    MAX_MEMORY_MB,
    MAX_PATTERN,
    MAX_TIMEOUT_S,
    MIN_MEMORY_MB,
    MIN_TIMEOUT_S,
    OUTPUT_TEXT,
    OWN_ERRORS,
    Bound,
    DocumentedAs,
    EvaluationMetric,
    LengthUnit,
    Spec,
    StringOperation,
    TemplateText,
    Text,
    all_unicode,
    refusal,
    refused_at,
    unicode_text,
)
from engine.graders.formula import Formula, FormulaError
from engine.graders.metrics import METRICS

MAX_GRADERS = 32  # a multi grader's sub-graders
MAX_DEPTH = 4  # multi graders inside multi graders
_FORMULA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class StringCheckSpec(Spec):
    """OpenAI's string_check: 1 when input and reference compare as operation says, else 0. eq:
    equal; ne: not equal; like: input contains reference; ilike: the same, ignoring case."""

    type: Literal["string_check"] = Field(description=KIND)
    input: TemplateText
    reference: TemplateText
    operation: StringOperation = Field(
        description="the comparison: eq, input equals reference; ne, it does not; like, input contains "
        "reference; ilike, the same, ignoring case (the others respect case)"
    )


class TextSimilaritySpec(Spec):
    """OpenAI's text_similarity: evaluation_metric of input against reference, in [0, 1] (cosine,
    which needs an embedding model, is not computed here)."""

    type: Literal["text_similarity"] = Field(description=KIND)
    input: TemplateText
    reference: TemplateText
    evaluation_metric: EvaluationMetric = Field(
        description="the similarity computed, in [0, 1]: fuzzy_match (rapidfuzz's ratio of the characters), "
        "bleu (sacrebleu's sentence BLEU), gleu (nltk's sentence GLEU), meteor (nltk's METEOR, exact "
        "and stem matches, no synonyms), rouge_1 to rouge_5 and rouge_l (rouge-score's F-measure); "
        "cosine is refused (it needs an embedding model)"
    )

    @field_validator("evaluation_metric")
    @classmethod
    def _computed(cls, metric: str) -> str:
        if metric not in METRICS:
            message = (
                f"{metric} needs an embedding model, which the graders do not run; use one of "
                f"{', '.join(METRICS)}"
            )
            raise refusal("metric", message)
        return metric


class RegexSpec(Spec):
    """Ours: 1 when pattern (Python's re syntax) is found in input, or matches all of it with
    full_match; else 0."""

    type: Literal["regex"] = Field(description=KIND)
    input: TemplateText = OUTPUT_TEXT
    pattern: Annotated[str, StringConstraints(max_length=MAX_PATTERN), AfterValidator(unicode_text)] = Field(
        description="a regular expression in Python's re syntax, searched for in input (with full_match: "
        "matched against all of it)"
    )
    full_match: StrictBool = Field(False, description="the whole input must match")
    ignore_case: StrictBool = Field(False, description="match regardless of case")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as exc:
            raise refusal("pattern", f"not a regular expression: {exc}") from None
        return pattern


def schema_validator(schema: Mapping[str, Any]) -> Any:
    """A ``jsonschema`` validator of ``schema``, its draft the one its ``$schema`` names (2020-12
    when none). Raises ``jsonschema``'s ``SchemaError`` when the schema is not valid."""
    from jsonschema import Draft202012Validator, validators

    kind = validators.validator_for(schema, default=Draft202012Validator)
    kind.check_schema(schema)
    return kind(schema)


class JsonSchemaSpec(Spec):
    """Ours: 1 when input parses as JSON and the value is valid against schema, else 0."""

    type: Literal["json_schema"] = Field(description=KIND)
    input: TemplateText = OUTPUT_TEXT
    json_schema: dict[str, Any] = Field(
        alias="schema", description="a JSON Schema; its $schema picks the draft (2020-12 when it names none)"
    )

    @field_validator("json_schema")
    @classmethod
    def _valid(cls, schema: dict[str, Any]) -> dict[str, Any]:
        all_unicode(schema, ())
        from jsonschema.exceptions import SchemaError

        try:
            schema_validator(schema)
        except SchemaError as exc:
            where = ".".join(str(p) for p in exc.path)
            at = f" at {where}" if where else ""
            raise refusal("schema", f"not a valid JSON Schema{at}: {exc.message}") from None
        except (ValueError, TypeError, RecursionError) as exc:
            raise refusal("schema", f"not a valid JSON Schema: {exc}") from None
        return schema


class LengthSpec(Spec):
    """Ours: a score from the length of input in units. With target_length: 1 at the target,
    falling linearly to 0 at min_length (default 0) and at max_length (default twice the target).
    Without: 1 from min_length to max_length, falling to 0 over falloff units outside."""

    type: Literal["length"] = Field(description=KIND)
    input: TemplateText = OUTPUT_TEXT
    unit: LengthUnit = Field(
        "characters",
        description="characters, or tokens: runs of letters, digits and underscores, and each other "
        "non-space character alone (not the model's tokenizer)",
    )
    min_length: Bound | None = Field(
        None,
        description="with target_length: where the score reaches 0 below it (default 0); without: the "
        "shortest length that scores 1 (default: no lower bound)",
    )
    max_length: Bound | None = Field(
        None,
        description="with target_length: where the score reaches 0 above it (default twice the target); "
        "without: the longest length that scores 1 (default: no upper bound)",
    )
    target_length: Bound | None = Field(
        None, description="the length that scores 1, the score falling linearly on either side of it"
    )
    falloff: Bound = Field(0, description="without target_length: units outside over which 1 falls to 0")

    @model_validator(mode="after")
    def _bounds(self) -> LengthSpec:
        low, high, target = self.min_length, self.max_length, self.target_length
        if low is None and high is None and target is None:
            message = "give target_length, min_length or max_length (or several)"
            raise refused_at(("target_length",), "length", message, None)
        if low is not None and high is not None and low > high:
            raise refused_at(
                ("max_length",), "length", f"must be at least min_length ({low}), got {high}", high
            )
        if target is not None:
            if low is not None and low > target:
                message = f"must be at most target_length ({target}), got {low}"
                raise refused_at(("min_length",), "length", message, low)
            if high is not None and high < target:
                message = f"must be at least target_length ({target}), got {high}"
                raise refused_at(("max_length",), "length", message, high)
            if self.falloff:
                message = "is for min_length/max_length without a target_length"
                raise refused_at(("falloff",), "length", message, self.falloff)
        return self


class PythonSpec(Spec):
    """OpenAI's python: source defines grade(sample, item) -> float, run in a sandboxed child
    process, each sample under timeout_s."""

    type: Literal["python"] = Field(description=KIND)
    source: Text = Field(description="Python source defining grade(sample, item) -> float")
    image_tag: Annotated[str, StringConstraints(max_length=256), AfterValidator(unicode_text)] | None = Field(
        None, description="OpenAI's: accepted and not used"
    )
    timeout_s: Annotated[StrictFloat, Field(ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)] = Field(
        DEFAULT_TIMEOUT_S, description="ours: seconds per sample"
    )
    memory_mb: Annotated[StrictInt, Field(ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB)] = Field(
        DEFAULT_MEMORY_MB, description="ours: the child process's address space"
    )


class MultiSpec(Spec):
    """OpenAI's multi: graders by name, and calculate_output, a formula over their names (numbers,
    + - * /, parentheses, min and max) that makes one score of theirs."""

    type: Literal["multi"] = Field(description=KIND)
    graders: dict[str, GraderSpec] = Field(
        min_length=1,
        max_length=MAX_GRADERS,
        description=f"1 to {MAX_GRADERS} graders by name: letters, digits and _, not starting with a "
        f"digit, not min or max; multi graders nest at most {MAX_DEPTH} deep",
    )
    calculate_output: Text = Field(description='e.g. "0.5 * a + 0.5 * b" or "min(a, b)"')

    @field_validator("graders", mode="before")
    @classmethod
    def _named(cls, given: Any) -> Any:
        if not isinstance(given, Mapping):
            return given
        if not given:
            raise refusal("graders", "give at least one grader, by name")
        if len(given) > MAX_GRADERS:
            raise refusal("graders", f"at most {MAX_GRADERS} graders, got {len(given)}")
        for key in given:
            if not isinstance(key, str) or not _FORMULA_NAME.match(key) or key in ("min", "max"):
                message = (
                    f"{key!r} cannot be named in calculate_output: a name is letters, digits and _, "
                    "not starting with a digit, and not min or max"
                )
                raise refusal("graders", message)
        return given

    @model_validator(mode="after")
    def _formula(self) -> MultiSpec:
        try:
            Formula.parse(self.calculate_output, set(self.graders))
        except FormulaError as exc:
            raise refused_at(("calculate_output",), "formula", str(exc), self.calculate_output) from None
        return self


def _located(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a spec; errors located by field names alone, nesting refused past ``MAX_DEPTH``."""
    too_deep = _too_deep(value, 0)
    if too_deep is not None:
        raise refused_at(
            (*too_deep, "type"), "depth", f"multi graders nest at most {MAX_DEPTH} deep", "multi"
        )
    try:
        return handler(value)
    except ValidationError as exc:
        raise _relocated(exc) from None


GraderSpec = Annotated[
    StringCheckSpec | TextSimilaritySpec | RegexSpec | JsonSchemaSpec | LengthSpec | PythonSpec | MultiSpec,
    Field(discriminator="type"),
    WrapValidator(_located),
]
# MultiSpec refers to GraderSpec, defined after it: its schema is completed on first use (defer_build)
# type -> its spec, in the union's order
GRADER_SPECS: dict[str, type[Spec]] = {
    get_args(spec.model_fields["type"].annotation)[0]: spec for spec in get_args(get_args(GraderSpec)[0])
}


# a grader's JSON object as it is, documented as a GraderSpec: for an edge that hands it on to
# validate_grader, which names the field at fault in its own error (the service's 400)
GraderJson = Annotated[dict[str, Any], DocumentedAs(GraderSpec)]


def as_given(spec: Spec) -> dict[str, Any]:
    """The JSON object ``spec`` was read from: the fields it was given (null ones left out), not
    the defaults; a python grader's source as it was."""
    return spec.model_dump(mode="json", exclude_unset=True, by_alias=True)


def _too_deep(value: Any, depth: int) -> tuple[str, ...] | None:
    """Where (below ``value``) a multi grader nests too deep, or None."""
    multi = isinstance(value, MultiSpec) or (isinstance(value, Mapping) and value.get("type") == "multi")
    if not multi:
        return None
    if depth >= MAX_DEPTH:
        return ()
    graders = value.graders if isinstance(value, MultiSpec) else value.get("graders")
    if isinstance(graders, Mapping):
        for key, sub in graders.items():
            found = _too_deep(sub, depth + 1)
            if found is not None:
                return ("graders", str(key), *found)
    return None


def _relocated(exc: ValidationError) -> ValidationError:
    """``exc`` with the union's tag left out of each location, and the union's own errors (no or
    an unknown type) located at ``type``."""
    details: list[InitErrorDetails] = []
    for error in exc.errors():
        loc = [_printable(p) for p in error["loc"]]
        kind, message = error["type"], error["msg"]
        tag = loc.pop(0) if loc and loc[0] in GRADER_SPECS else None
        if kind == "model_attributes_type":
            message = "Input should be an object"
        elif kind == "union_tag_not_found":
            loc.append("type")
            kind, message = "missing", "Field required"
        elif kind == "union_tag_invalid":
            loc.append("type")
            kind, message = "literal_error", f"Input should be one of {', '.join(GRADER_SPECS)}"
            if isinstance(error["input"], Mapping):
                error["input"] = error["input"].get("type")
        elif kind == "extra_forbidden" and isinstance(tag, str):
            fields = ", ".join(f.alias or n for n, f in GRADER_SPECS[tag].model_fields.items())
            kind, message = OWN_ERRORS + "field", f"a {tag} grader has no such field (its fields: {fields})"
        detail = InitErrorDetails(
            type=PydanticCustomError(kind, message), loc=tuple(loc), input=error["input"]
        )
        details.append(detail)
    return ValidationError.from_exception_data(exc.title, details)


def _printable(part: str | int) -> str | int:
    """A location's part as text that can be written out (a lone surrogate escaped)."""
    if isinstance(part, str) and not part.isascii():
        return part.encode("utf-8", "backslashreplace").decode()
    return part
