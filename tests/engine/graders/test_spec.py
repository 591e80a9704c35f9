"""``GraderSpec``, the pydantic union of the grader types: its JSON schema lists every type with its
fields, a bad grader's error names the same dotted path wherever it is validated (alone, inside a
multi grader, as a job's ``method.grader``), and a spec dumps as it was given."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import TypeAdapter

from engine.config import method_options
from engine.errors import ConfigError
from engine.graders import GRADER_TYPES, GraderSpec, as_given, parse_grader, validate_grader
from engine.graders.spec import GRADER_SPECS, MAX_DEPTH, MultiSpec, RegexSpec

# each type's fields, as OpenAI names them where OpenAI has the grader: written out again here on
# purpose, so that a field renamed or dropped in the spec fails this test
FIELDS = {
    "string_check": {"type", "name", "input", "reference", "operation"},
    "text_similarity": {"type", "name", "input", "reference", "evaluation_metric"},
    "python": {"type", "name", "source", "image_tag", "timeout_s", "memory_mb"},
    "multi": {"type", "name", "graders", "calculate_output"},
    "regex": {"type", "name", "input", "pattern", "full_match", "ignore_case"},
    "json_schema": {"type", "name", "input", "schema"},
    "length": {"type", "name", "input", "unit", "min_length", "max_length", "target_length", "falloff"},
}
REGEX = {"type": "regex", "pattern": "x"}


def refused(spec: Any, field: str = "grader") -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_grader(spec, field)
    assert str(caught.value).startswith(f"{caught.value.field}: "), caught.value
    return caught.value


def test_the_schema_lists_every_type_with_its_fields() -> None:
    schema = TypeAdapter(GraderSpec).json_schema()
    definitions = schema["$defs"]
    assert set(schema["discriminator"]["mapping"]) == set(FIELDS) == set(GRADER_TYPES) == set(GRADER_SPECS)
    assert schema["discriminator"]["propertyName"] == "type"
    for kind, fields in FIELDS.items():
        definition = definitions[schema["discriminator"]["mapping"][kind].removeprefix("#/$defs/")]
        assert set(definition["properties"]) == fields, kind
        assert definition["properties"]["type"]["const"] == kind
        assert definition["additionalProperties"] is False
        assert definition["description"]  # the type's docstring: what it scores
    # the bounds and choices the checks hold are in the schema too
    props = {kind: definitions[kind]["properties"] for kind in ("StringCheckSpec", "PythonSpec", "MultiSpec")}
    assert props["StringCheckSpec"]["operation"]["enum"] == ["eq", "ne", "like", "ilike"]
    timeout = props["PythonSpec"]["timeout_s"]["anyOf"][0]
    assert (timeout["minimum"], timeout["maximum"]) == (0.01, 60)
    graders = props["MultiSpec"]["graders"]
    assert (graders["minProperties"], graders["maxProperties"]) == (1, 32)
    assert {c["$ref"] for c in graders["additionalProperties"]["oneOf"]} == set(
        schema["discriminator"]["mapping"].values()
    )
    # a field that may be left out may be null (read as left out), one that is required may not
    assert {"type": "null"} in definitions["RegexSpec"]["properties"]["full_match"]["anyOf"]
    assert "anyOf" not in definitions["RegexSpec"]["properties"]["pattern"]
    assert set(definitions["RegexSpec"]["required"]) == {"type", "pattern"}


def check(operation: str = "eq") -> dict[str, Any]:
    return {
        "type": "string_check",
        "input": "{{sample.output_text}}",
        "reference": "{{item.a}}",
        "operation": operation,
    }


BAD = [
    ("string_check", ""),
    ({}, "type"),
    ({"type": "model"}, "type"),
    ({"type": 3}, "type"),
    ({"type": "regex"}, "pattern"),
    ({"type": "regex", "pattern": None}, "pattern"),  # null is left out: still required
    ({**REGEX, "pattern": "("}, "pattern"),
    ({**REGEX, "flags": "i"}, "flags"),
    ({**REGEX, "full_match": "yes"}, "full_match"),
    ({**REGEX, "ignore_case": 1}, "ignore_case"),
    ({**REGEX, "name": ""}, "name"),
    ({**REGEX, "name": "a\nb"}, "name"),
    ({**REGEX, "name": "x" * 257}, "name"),
    ({**REGEX, "input": "{{answer}}"}, "input"),
    ({**REGEX, "pattern": "x" * 2001}, "pattern"),
    (check("equals"), "operation"),
    (check() | {"input": 3}, "input"),
    (check() | {"reference": "{{sample.text}}"}, "reference"),
    (check() | {"reference": "{{item.a"}, "reference"),
    (
        {**check(), "type": "text_similarity", "operation": None, "evaluation_metric": "cosine"},
        "evaluation_metric",
    ),
    ({"type": "json_schema"}, "schema"),
    ({"type": "json_schema", "schema": {"type": "nothing"}}, "schema"),
    ({"type": "json_schema", "schema": {"enum": ["\ud800"]}}, "schema.enum.0"),
    ({"type": "length"}, "target_length"),
    ({"type": "length", "min_length": 5, "max_length": 2}, "max_length"),
    ({"type": "length", "target_length": 5, "min_length": 6}, "min_length"),
    ({"type": "length", "target_length": 5, "max_length": 4}, "max_length"),
    ({"type": "length", "target_length": 5, "falloff": 2}, "falloff"),
    ({"type": "length", "target_length": -1}, "target_length"),
    ({"type": "length", "target_length": 1.5}, "target_length"),
    ({"type": "length", "max_length": 3, "unit": "words"}, "unit"),
    ({"type": "python"}, "source"),
    ({"type": "python", "source": "x", "timeout_s": 0}, "timeout_s"),
    ({"type": "python", "source": "x", "timeout_s": float("nan")}, "timeout_s"),
    ({"type": "python", "source": "x", "memory_mb": 100}, "memory_mb"),
    ({"type": "python", "source": "x" * 100_001}, "source"),
    ({"type": "multi", "graders": {}, "calculate_output": "1"}, "graders"),
    ({"type": "multi", "graders": {f"g{i}": REGEX for i in range(33)}, "calculate_output": "1"}, "graders"),
    ({"type": "multi", "graders": {"bad-name": REGEX}, "calculate_output": "1"}, "graders"),
    ({"type": "multi", "graders": {"min": REGEX}, "calculate_output": "1"}, "graders"),
    ({"type": "multi", "graders": {"a": REGEX}, "calculate_output": "a + b"}, "calculate_output"),
    ({"type": "multi", "graders": {"a": REGEX}, "calculate_output": "a +"}, "calculate_output"),
    ({"type": "multi", "graders": {"a": REGEX}}, "calculate_output"),
    ({"type": "multi", "graders": {"a": {"type": "regex"}}, "calculate_output": "a"}, "graders.a.pattern"),
    ({"type": "multi", "graders": {"a": check("x")}, "calculate_output": "a"}, "graders.a.operation"),
]


def at(base: str, rest: str) -> str:
    return f"{base}.{rest}" if rest else base


@pytest.mark.parametrize(("spec", "path"), BAD)
def test_an_error_names_the_field_alone_nested_and_in_a_job(spec: Any, path: str) -> None:
    assert refused(spec).field == at("grader", path)
    # inside a multi grader (inside another), the path goes on from the sub-grader's key
    inner = {"type": "multi", "graders": {"b": spec}, "calculate_output": "b"}
    assert refused({"type": "multi", "graders": {"a": inner}, "calculate_output": "a"}).field == at(
        "grader.graders.a.graders.b", path
    )
    assert refused(spec, "method.grader").field == at("method.grader", path)
    with pytest.raises(ConfigError) as caught:  # a job's method section: the same path
        method_options(objective="grpo", grader=spec)
    assert caught.value.field == at("method.grader", path), caught.value


def test_messages_name_the_value() -> None:
    error = refused(check("equals"))
    assert str(error) == "grader.operation: Input should be 'eq', 'ne', 'like' or 'ilike' (got \"equals\")"
    assert str(refused({**REGEX, "flags": "i"})) == (
        "grader.flags: a regex grader has no such field (its fields: type, name, input, pattern, full_match, "
        "ignore_case)"
    )
    assert str(refused({"type": "model"})).endswith('(got "model")')
    # every problem is listed, the field is the first one's
    error = refused({"type": "length", "unit": "words", "falloff": -1, "max_length": 3})
    assert error.field == "grader.unit" and "; grader.falloff: " in str(error)


def test_multi_graders_nest_at_most_four_deep() -> None:
    spec: dict[str, Any] = REGEX
    for _ in range(MAX_DEPTH):
        spec = {"type": "multi", "graders": {"a": spec}, "calculate_output": "a"}
    assert isinstance(parse_grader(spec), MultiSpec)
    deeper = {"type": "multi", "graders": {"a": spec}, "calculate_output": "a"}
    error = refused(deeper)
    assert error.field == "grader" + ".graders.a" * MAX_DEPTH + ".type"
    assert "multi graders nest at most 4 deep" in str(error)


def test_a_spec_dumps_as_it_was_given() -> None:
    source = "def grade(sample, item):\n\treturn 1.0  # é\r\n\n"
    given = {
        "type": "multi",
        "graders": {
            "p": {"type": "python", "source": source, "image_tag": None},
            "s": {"type": "json_schema", "schema": {"type": "string"}},
            "r": {"type": "regex", "pattern": " x ", "full_match": False},
        },
        "calculate_output": "p + s + r",
    }
    spec = parse_grader(given)
    assert as_given(spec) == {  # null left out, no default added, "schema" by its name
        "type": "multi",
        "graders": {
            "p": {"type": "python", "source": source},
            "s": {"type": "json_schema", "schema": {"type": "string"}},
            "r": {"type": "regex", "pattern": " x ", "full_match": False},
        },
        "calculate_output": "p + s + r",
    }
    assert parse_grader(as_given(spec)) == spec
    # a job keeps its grader as given
    options = method_options(objective="grpo", grader=given["graders"]["r"])
    assert options.model_dump(mode="json")["grader"] == {
        "type": "regex",
        "pattern": " x ",
        "full_match": False,
    }


def test_a_spec_builds_its_grader() -> None:
    spec = parse_grader(
        {"type": "multi", "graders": {"a": REGEX, "b": REGEX | {"name": "bee"}}, "calculate_output": "a"}
    )
    assert isinstance(spec, MultiSpec) and isinstance(spec.graders["a"], RegexSpec)
    with validate_grader(spec) as grader:  # a spec is taken as it is
        assert grader.name == "multi"
        assert [g.name for g in grader.graders.values()] == ["a", "bee"]  # type: ignore[attr-defined]
        assert grader.grade("x", {}) == (1.0, None)
    assert type(validate_grader(REGEX)) is GRADER_TYPES["regex"]
