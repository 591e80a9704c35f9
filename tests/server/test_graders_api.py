"""``/v1/fine_tuning/alpha/graders``: validate and run, in OpenAI's shapes (the official client
drives them), a 400 naming the field of a bad grader, and our ``samples`` extension."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

VALIDATE = "/v1/fine_tuning/alpha/graders/validate"
RUN = "/v1/fine_tuning/alpha/graders/run"


def check(operation: str = "eq") -> dict[str, Any]:
    return {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
        "operation": operation,
    }


def multi() -> dict[str, Any]:
    return {
        "type": "multi",
        "name": "total",
        "graders": {
            "a": check(),
            "b": {
                "type": "text_similarity",
                "name": "similar",
                "input": "{{sample.output_text}}",
                "reference": "{{item.reference_answer}}",
                "evaluation_metric": "rouge_1",
            },
        },
        "calculate_output": "0.5 * a + 0.5 * b",
    }


def test_validate_answers_the_grader_with_its_defaults(client: TestClient) -> None:
    r = client.post(VALIDATE, json={"grader": check()})
    assert r.status_code == 200, r.text
    assert r.json() == {"grader": check()}
    r = client.post(VALIDATE, json={"grader": {"type": "regex", "pattern": "^\\d+$"}})
    assert r.json()["grader"] == {
        "type": "regex",
        "name": "regex",
        "input": "{{sample.output_text}}",
        "pattern": "^\\d+$",
        "full_match": False,
        "ignore_case": False,
    }


def test_a_bad_grader_is_a_400_naming_the_field(client: TestClient) -> None:
    spec = multi()
    spec["graders"]["b"] = check("equals")
    r = client.post(VALIDATE, json={"grader": spec})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "grader.graders.b.operation"
    assert error["message"] == (
        "grader.graders.b.operation: Input should be 'eq', 'ne', 'like' or 'ilike' (got \"equals\")"
    )
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_grader")
    r = client.post(RUN, json={"grader": {"type": "regex"}, "model_sample": "x"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "grader.pattern")
    r = client.post(VALIDATE, json={"grader": "string_check"})  # not an object: the request's own check
    assert (r.status_code, r.json()["error"]["param"]) == (400, "grader")
    r = client.post(VALIDATE, json={"grader": {"type": "python", "source": "def grade(sample):\n  return 1"}})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "grader.source")
    assert "grade must take two arguments" in r.json()["error"]["message"]


def test_the_openapi_schema_shows_every_grader_type(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]

    def grader_of(component: str) -> dict[str, Any]:
        return dict(components[component]["properties"]["grader"])

    # the request bodies of validate and run, a reinforcement job's method and the job as answered
    shown = [grader_of(c) for c in ("GraderValidate", "GraderRun", "ReinforcementMethod", "JobReinforcement")]
    mapping = shown[0]["discriminator"]["mapping"]
    assert set(mapping) == {
        "string_check",
        "text_similarity",
        "python",
        "multi",
        "regex",
        "json_schema",
        "length",
    }
    for grader in shown:
        assert grader["discriminator"] == {"propertyName": "type", "mapping": mapping}
        assert {choice["$ref"] for choice in grader["oneOf"]} == set(mapping.values())
    for kind, ref in mapping.items():
        definition = components[ref.removeprefix("#/components/schemas/")]
        assert definition["properties"]["type"]["const"] == kind
    multi = components[mapping["multi"].removeprefix("#/components/schemas/")]
    assert {"graders", "calculate_output"} <= set(multi["properties"]) and set(multi["required"]) == {
        "type",
        "graders",
        "calculate_output",
    }
    check_fields = components[mapping["string_check"].removeprefix("#/components/schemas/")]["properties"]
    assert check_fields["operation"]["enum"] == ["eq", "ne", "like", "ilike"]
    body = schema["paths"][VALIDATE]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/GraderValidate"}


def test_run_in_openais_shape(client: TestClient) -> None:
    body = {"grader": multi(), "model_sample": "the cat", "item": {"reference_answer": "the cat sat"}}
    r = client.post(RUN, json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    # a: not equal (0); b: ROUGE-1 of "the cat" against "the cat sat" = 0.8 -> 0.5 * 0 + 0.5 * 0.8
    assert answer["reward"] == pytest.approx(0.4)
    assert answer["sub_rewards"] == {"a": 0.0, "b": pytest.approx(0.8)}
    metadata = answer["metadata"]
    assert (metadata["name"], metadata["type"]) == ("total", "multi")
    assert metadata["scores"] == answer["sub_rewards"]
    assert metadata["token_usage"] is None and metadata["sampled_model_name"] is None
    assert metadata["execution_time"] >= 0
    assert not any(v for k, v in metadata["errors"].items() if k != "messages")
    assert answer["model_grader_token_usage_per_model"] == {}
    assert answer["rewards"] is None  # ours, only with samples


def test_a_grader_that_fails_on_the_sample_reports_it(client: TestClient) -> None:
    body = {"grader": check(), "model_sample": "4", "item": {"answer": "4"}}  # no reference_answer
    answer = client.post(RUN, json=body).json()
    assert answer["reward"] == 0.0
    errors = answer["metadata"]["errors"]
    assert errors["invalid_variable_error"] is True
    assert errors["messages"] == ["{{item.reference_answer}}: item has no field 'reference_answer'"]
    source = "def grade(sample, item):\n    return 1 / 0\n"
    body = {"grader": {"type": "python", "name": "py", "source": source}, "model_sample": "4"}
    answer = client.post(RUN, json=body).json()
    assert answer["reward"] == 0.0
    errors = answer["metadata"]["errors"]
    assert errors["python_grader_runtime_error"] is True
    assert errors["python_grader_runtime_error_details"] == "ZeroDivisionError: division by zero (line 2)"


def test_run_on_several_samples(client: TestClient) -> None:
    source = "def grade(sample, item):\n    return float(sample['output_text'] == item['answer'])\n"
    grader = {"type": "python", "name": "py", "source": source}
    samples = [
        {"model_sample": "4", "item": {"answer": "4"}},
        {"model_sample": "5", "item": {"answer": "4"}},
        {"model_sample": "4", "item": {}},
        {"model_sample": "7", "item": {"answer": "7"}},
        {"model_sample": "x", "item": {"answer": "x"}},
    ]
    r = client.post(RUN, json={"grader": grader, "samples": samples})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["rewards"] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert answer["reward"] == pytest.approx(0.6)
    assert answer["sample_errors"] == [None, None, "KeyError: 'answer' (line 2)", None, None]
    assert answer["sample_sub_rewards"] == {"py": [1.0, 0.0, 0.0, 1.0, 1.0]}
    assert answer["metadata"]["errors"]["python_grader_runtime_error"] is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"grader": check()}, "model_sample"),
        ({"grader": check(), "model_sample": "4", "samples": [{"model_sample": "4"}]}, "samples"),
        ({"grader": check(), "samples": []}, "samples"),
        ({"grader": check(), "samples": [{"model_sample": "4"}] * 21}, "samples"),
        ({"grader": check(), "samples": [{"item": {}}]}, "samples.0.model_sample"),
        ({"grader": check(), "model_sample": 4}, "model_sample"),
        ({"grader": check(), "model_sample": "4", "item": []}, "item"),
        ({"grader": check(), "model_sample": "4", "extra": 1}, "extra"),
        ({"model_sample": "4"}, "grader"),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field(
    client: TestClient, body: dict[str, Any], param: str
) -> None:
    r = client.post(RUN, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_key_is_required(client: TestClient) -> None:
    r = client.post(VALIDATE, json={"grader": check()}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


def test_the_official_client_drives_it(client: TestClient) -> None:
    key = client.headers["Authorization"].removeprefix("Bearer ")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)
    validated = api.fine_tuning.alpha.graders.validate(grader=check())  # type: ignore[arg-type]
    assert validated.grader is not None and validated.grader.name == "exact"
    ran = api.fine_tuning.alpha.graders.run(
        grader=check("ilike"),  # type: ignore[arg-type]
        model_sample="It is PARIS.",
        item={"reference_answer": "paris"},
    )
    assert ran.reward == 1.0 and ran.sub_rewards == {"exact": 1.0}
    assert ran.metadata.errors.python_grader_runtime_error is False
    with pytest.raises(openai.BadRequestError) as caught:
        api.fine_tuning.alpha.graders.validate(grader=check("equals"))  # type: ignore[arg-type]
    assert caught.value.param == "grader.operation"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"grader": {"type": "regex", "pattern": "x", "name": "\\ud800"}}', "grader.name"),
        (b'{"grader": {"type": "json_schema", "schema": {"enum": ["\\udfff"]}}}', "grader.schema.enum.0"),
    ],
)
def test_text_that_is_not_unicode_is_a_400(client: TestClient, body: bytes, param: str) -> None:
    headers = {"content-type": "application/json"}
    r = client.post(VALIDATE, content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    run_body = body[:-1] + b', "model_sample": "x", "item": {"k": "\\ud800"}}'
    assert client.post(RUN, content=run_body, headers=headers).status_code == 400
    item_only = (
        b'{"grader": {"type": "regex", "pattern": "x"}, "model_sample": "x", "item": {"k": "\\ud800"}}'
    )
    r = client.post(RUN, content=item_only, headers=headers)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "item.k")
