"""The graders that run in this process, their templates, the multi grader's formula and sub-rewards,
and validation errors that name the field at fault."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine.errors import ConfigError
from engine.graders import GRADER_TYPES, GradeResult, make_sample, validate_grader


def grade(spec: dict[str, Any], samples: list[str], items: list[dict[str, Any]] | None = None) -> GradeResult:
    with validate_grader(spec) as grader:
        return grader.grade_batch(samples, items if items is not None else [{}] * len(samples))


def refused(spec: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        validate_grader(spec)
    assert str(caught.value).startswith(f"{caught.value.field}: ")  # the message names the field
    return caught.value


def check(operation: str, reference: str = "{{item.answer}}") -> dict[str, Any]:
    return {
        "type": "string_check",
        "name": "check",
        "input": "{{sample.output_text}}",
        "reference": reference,
        "operation": operation,
    }


def test_the_sample_is_openai_shaped() -> None:
    sample = make_sample('{"answer": 4}')
    assert sample["output_text"] == '{"answer": 4}'
    assert sample["output_json"] == {"answer": 4}
    assert sample["choices"][0]["message"] == {"role": "assistant", "content": '{"answer": 4}'}
    assert make_sample("not json")["output_json"] is None
    assert make_sample("[" * 100_000)["output_json"] is None  # too deep: not JSON, no error


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        ("eq", [1.0, 0.0, 0.0, 0.0]),
        ("ne", [0.0, 1.0, 1.0, 1.0]),
        ("like", [1.0, 0.0, 1.0, 0.0]),  # the answer contains the reference
        ("ilike", [1.0, 0.0, 1.0, 1.0]),  # ... ignoring case
    ],
)
def test_string_check(operation: str, expected: list[float]) -> None:
    samples = ["Paris", "Lyon", "It is Paris.", "PARIS"]
    result = grade(check(operation), samples, [{"answer": "Paris"}] * 4)
    assert result.rewards == expected
    assert result.sub_rewards == {"check": expected}  # a single grader: its own name
    assert result.errors == [None] * 4


def test_templates_reach_into_the_item_and_the_sample() -> None:
    spec = check("eq", "The answer is {{ item.solution.value }} ({{item.unit}})")
    items = [{"solution": {"value": 4}, "unit": "m"}, {"solution": {"value": 5}, "unit": "m"}]
    assert grade(spec, ["The answer is 4 (m)", "The answer is 4 (m)"], items).rewards == [1.0, 0.0]
    # a list is indexed by number, output_json is the parsed answer, a non-string is JSON
    spec = check("eq", "{{item.answers.1}}") | {"input": "{{sample.output_json.pick}}"}
    assert grade(spec, ['{"pick": "b"}'], [{"answers": ["a", "b"]}]).rewards == [1.0]
    spec = check("eq", "{{item.expected}}") | {"input": "{{sample.output_json}}"}
    assert grade(spec, ['{"a":[1,true]}'], [{"expected": {"a": [1, True]}}]).rewards == [1.0]
    assert grade(spec, ['{"a":[1,true]}'], [{"expected": {"a": [1, False]}}]).rewards == [0.0]
    assert grade(spec, ["not json"], [{"expected": ""}]).rewards == [1.0]  # null renders as nothing


def test_a_missing_item_field_fails_that_sample_only() -> None:
    result = grade(check("eq"), ["4", "4"], [{"answer": "4"}, {"other": "4"}])
    assert result.rewards == [1.0, 0.0]
    assert result.errors[0] is None
    assert result.errors[1] == "{{item.answer}}: item has no field 'answer'"
    assert result.error_kinds == [None, "template"]


def test_text_similarity_uses_the_metric() -> None:
    spec = {
        "type": "text_similarity",
        "name": "sim",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
        "evaluation_metric": "bleu",
    }
    items = [{"reference_answer": "the cat is on the mat"}]
    assert grade(spec, ["the cat sat on the mat"], items).rewards == [
        pytest.approx((1 / 48) ** 0.25)
    ]  # sacrebleu: (5/6 * 3/5 * 1/4 * 1/6) ** (1/4)
    spec["evaluation_metric"] = "rouge_l"
    assert grade(spec, ["the cat sat on the mat"], items).rewards == [pytest.approx(5 / 6)]
    spec["evaluation_metric"] = "fuzzy_match"
    assert grade(spec, ["kitten"], [{"reference_answer": "sitting"}]).rewards == [pytest.approx(8 / 13)]


def test_regex() -> None:
    spec = {"type": "regex", "pattern": r"\d+"}
    assert grade(spec, ["answer: 42", "none"]).rewards == [1.0, 0.0]
    spec = {"type": "regex", "pattern": r"\d+", "full_match": True}
    assert grade(spec, ["answer: 42", "42"]).rewards == [0.0, 1.0]
    spec = {"type": "regex", "pattern": "^yes$", "ignore_case": True, "input": "{{item.said}}"}
    assert grade(spec, ["", ""], [{"said": "YES"}, {"said": "no"}]).rewards == [1.0, 0.0]
    with validate_grader({"type": "regex", "pattern": "x"}) as grader:
        assert (grader.name, grader.type) == ("regex", "regex")


def test_json_schema() -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    spec = {"type": "json_schema", "name": "shape", "schema": schema}
    samples = [
        '{"answer": 4}',
        ' {"answer": 4}\n',
        '{"answer": -1}',
        '{"answer": 4, "x": 1}',
        "answer: 4",
        "null",
    ]
    assert grade(spec, samples).rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # null is JSON: a schema that allows it passes it
    assert grade({"type": "json_schema", "schema": {"type": "null"}}, ["null", "{}"]).rewards == [1.0, 0.0]


def test_length_against_a_target() -> None:
    # target 10, min 5, max 20 characters: 1 at 10, linear to 0 at 5 and at 20
    spec = {"type": "length", "target_length": 10, "min_length": 5, "max_length": 20}
    samples = ["x" * n for n in (0, 5, 7, 10, 15, 20, 30)]
    assert grade(spec, samples).rewards == pytest.approx([0.0, 0.0, 0.4, 1.0, 0.5, 0.0, 0.0])
    # without bounds: from 0 up to the target, down to 0 at twice the target
    spec = {"type": "length", "target_length": 4}
    assert grade(spec, ["", "xx", "xxxx", "xxxxxx", "x" * 9]).rewards == pytest.approx(
        [0.0, 0.5, 1.0, 0.5, 0.0]
    )


def test_length_within_bounds_in_tokens() -> None:
    # 1 within [2, 4] tokens (words and punctuation marks), falling over 2 tokens outside
    spec = {"type": "length", "unit": "tokens", "min_length": 2, "max_length": 4, "falloff": 2}
    samples = ["", "one", "one two", "one, two!", "a b c d e", "a b c d e f", "a b c d e f g"]
    assert grade(spec, samples).rewards == pytest.approx([0.0, 0.5, 1.0, 1.0, 0.5, 0.0, 0.0])
    spec = {"type": "length", "max_length": 3}  # no falloff: straight to 0
    assert grade(spec, ["abc", "abcd"]).rewards == [1.0, 0.0]


def multi() -> dict[str, Any]:
    return {
        "type": "multi",
        "name": "total",
        "graders": {
            "exact": check("eq"),
            "similar": {
                "type": "text_similarity",
                "input": "{{sample.output_text}}",
                "reference": "{{item.answer}}",
                "evaluation_metric": "rouge_1",
            },
            "short": {"type": "length", "max_length": 12},
        },
        "calculate_output": "0.5 * exact + 0.3 * similar + 0.2 * short",
    }


def test_multi_combines_named_graders_with_its_formula() -> None:
    items = [{"answer": "the cat sat"}] * 3
    result = grade(multi(), ["the cat sat", "the cat", "a dog sat on the mat"], items)
    # 1: exact 1, rouge_1 1, 11 characters -> 1.0
    # 2: exact 0, rouge_1 of "the cat" vs "the cat sat" = 0.8, short -> 0.3 * 0.8 + 0.2 = 0.44
    # 3: exact 0, rouge_1: 2 of 6 / 2 of 3 words ("sat", "the") -> F1 = 2 * (1/3) * (2/3) / 1 = 4/9,
    #    20 characters -> 0.3 * 4/9
    assert result.rewards == pytest.approx([1.0, 0.44, 0.3 * 4 / 9])
    assert result.sub_rewards["exact"] == [1.0, 0.0, 0.0]
    assert result.sub_rewards["similar"] == pytest.approx([1.0, 0.8, 4 / 9])
    assert result.sub_rewards["short"] == [1.0, 1.0, 0.0]
    assert set(result.sub_rewards) == {"exact", "similar", "short"}
    assert result.errors == [None, None, None]


def test_multi_reports_a_sub_graders_failure_and_nests() -> None:
    spec = multi()
    spec["graders"]["inner"] = {
        "type": "multi",
        "graders": {"x": {"type": "regex", "pattern": "cat"}, "y": {"type": "regex", "pattern": "dog"}},
        "calculate_output": "max(x, y)",
    }
    spec["calculate_output"] = "exact + inner"
    result = grade(spec, ["the cat sat", "a dog"], [{"answer": "the cat sat"}, {}])
    assert result.rewards == [2.0, 1.0]
    assert result.sub_rewards["inner.x"] == [1.0, 0.0] and result.sub_rewards["inner.y"] == [0.0, 1.0]
    assert result.errors[0] is None
    # the second item has no answer: exact and similar fail (0), the formula still runs
    missing = "{{item.answer}}: item has no field 'answer'"
    assert result.errors[1] == f"exact: {missing}; similar: {missing}"
    assert result.error_kinds[1] == "template"


def test_a_formula_that_cannot_be_computed_fails_the_sample() -> None:
    spec = {
        "type": "multi",
        "graders": {"a": {"type": "regex", "pattern": "a"}, "b": {"type": "regex", "pattern": "b"}},
        "calculate_output": "a / b",
    }
    result = grade(spec, ["ab", "a"])
    assert result.rewards == [1.0, 0.0]
    assert result.errors == [None, "calculate_output: division by zero"]
    assert result.error_kinds == [None, "formula"]


def test_the_spec_comes_back_with_its_defaults() -> None:
    with validate_grader(multi()) as grader:
        assert (grader.name, grader.type) == ("total", "multi")
        spec = grader.spec()
    assert spec["graders"]["similar"]["name"] == "similar"  # a sub-grader is named by its key
    assert spec["graders"]["short"] == {
        "type": "length",
        "name": "short",
        "input": "{{sample.output_text}}",
        "unit": "characters",
        "min_length": None,
        "max_length": 12,
        "target_length": None,
        "falloff": 0,
    }
    with validate_grader(spec) as again:  # what spec() gives validates to the same grader
        assert again.spec() == spec


def test_grade_batch_wants_one_item_per_sample() -> None:
    with validate_grader(check("eq")) as grader, pytest.raises(ValueError, match="2 samples but 1 items"):
        grader.grade_batch(["a", "b"], [{}])
    with validate_grader(check("eq")) as grader:
        assert grader.grade_batch([], []).rewards == []


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ("string_check", "grader", 'Input should be an object (got "string_check")'),
        ({}, "grader.type", "Field required"),
        (
            {"type": "model"},
            "grader.type",
            "Input should be one of string_check, text_similarity, regex, json_schema, length, python, multi",
        ),
        ({"type": "regex"}, "grader.pattern", "Field required"),
        ({"type": "regex", "pattern": "("}, "grader.pattern", "not a regular expression"),
        ({"type": "regex", "pattern": "x", "flags": "i"}, "grader.flags", "a regex grader has no such field"),
        (
            {"type": "regex", "pattern": "x", "full_match": "yes"},
            "grader.full_match",
            'Input should be a valid boolean (got "yes")',  # strict: not "yes", nor 1
        ),
        ({"type": "regex", "pattern": "x", "name": ""}, "grader.name", "must be one line of text"),
        (
            check("equals"),
            "grader.operation",
            "Input should be 'eq', 'ne', 'like' or 'ilike' (got \"equals\")",
        ),
        (check("eq") | {"input": 3}, "grader.input", "Input should be a valid string (got 3)"),
        (check("eq", "{{answer}}"), "grader.reference", "{{answer}} names neither the sample nor the item"),
        (check("eq", "{{sample.text}}"), "grader.reference", "a sample has sample.output_text"),
        (check("eq", "{{item.answer"), "grader.reference", "a '{{' is not closed"),
        (
            check("eq") | {"type": "text_similarity", "operation": None, "evaluation_metric": "cosine"},
            "grader.evaluation_metric",
            "cosine needs an embedding model",
        ),
        (
            check("eq") | {"type": "text_similarity", "operation": None, "evaluation_metric": "rouge_9"},
            "grader.evaluation_metric",
            "Input should be 'fuzzy_match', 'bleu',",
        ),
        ({"type": "json_schema"}, "grader.schema", "Field required"),
        ({"type": "json_schema", "schema": {"type": "nothing"}}, "grader.schema", "not a valid JSON Schema"),
        ({"type": "length"}, "grader.target_length", "give target_length, min_length or max_length"),
        (
            {"type": "length", "min_length": 5, "max_length": 2},
            "grader.max_length",
            "must be at least min_length",
        ),
        (
            {"type": "length", "target_length": -1},
            "grader.target_length",
            "greater than or equal to 0 (got -1)",
        ),
        ({"type": "length", "target_length": 1.5}, "grader.target_length", "a valid integer (got 1.5)"),
        ({"type": "length", "target_length": 5, "falloff": 2}, "grader.falloff", "without a target_length"),
        ({"type": "python"}, "grader.source", "Field required"),
        (
            {"type": "python", "source": "x", "timeout_s": 0},
            "grader.timeout_s",
            "greater than or equal to 0.01",
        ),
        ({"type": "multi", "graders": {}, "calculate_output": "1"}, "grader.graders", "at least one grader"),
    ],
)
def test_validation_names_the_field(spec: Any, field: str, message: str) -> None:
    error = refused(spec)
    assert error.field == field
    assert message in str(error), str(error)


def test_validation_names_the_field_inside_a_multi_grader() -> None:
    spec = multi()
    spec["graders"]["b"] = check("equals")
    error = refused(spec)
    assert error.field == "grader.graders.b.operation"
    assert (
        str(error)
        == "grader.graders.b.operation: Input should be 'eq', 'ne', 'like' or 'ilike' (got \"equals\")"
    )
    spec = multi()
    spec["graders"]["inner"] = {"type": "multi", "graders": {"r": {"type": "regex"}}, "calculate_output": "r"}
    assert refused(spec).field == "grader.graders.inner.graders.r.pattern"
    spec = multi()
    spec["calculate_output"] = "exact + missing"
    error = refused(spec)
    assert error.field == "grader.calculate_output"
    assert "'missing' at character 9 is not a grader's name (names: exact, short, similar)" in str(error)
    spec = multi()
    spec["graders"]["bad-name"] = check("eq")
    assert refused(spec).field == "grader.graders"
    # a field name other than "grader"
    with pytest.raises(ConfigError) as caught:
        validate_grader({"type": "regex"}, field="method.grader")
    assert caught.value.field == "method.grader.pattern"


def test_every_type_is_listed() -> None:
    assert set(GRADER_TYPES) == {
        "string_check",
        "text_similarity",
        "regex",
        "json_schema",
        "length",
        "python",
        "multi",
    }


def test_importing_the_graders_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, engine.graders; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_scores_are_finite() -> None:
    result = grade(multi(), ["x"], [{"answer": "y"}])
    assert all(math.isfinite(r) for r in result.rewards)
