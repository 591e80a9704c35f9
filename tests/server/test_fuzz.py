"""Schemathesis fuzzes every operation of the OpenAPI schema on SQLite and on PostgreSQL: no 5xx,
every answer as documented, every schema-invalid request refused with a 4xx (``tests/utils/fuzzing``).

Derandomized: the same cases every run. ``bench/fuzz.py`` runs longer, with seeds of its own."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.utils.fuzzing import fuzz

EXAMPLES = 15  # per operation, mode (positive, negative) and kind of ids (generated, existing)


def test_every_operation_documents_its_errors_in_the_one_shape(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert not {"HTTPValidationError", "ValidationError"} & set(schema["components"]["schemas"])
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    # /v1 (OpenAI's API): its own error shape, and a request that does not validate is a 400
    openai_error = {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIErrorBody"}}}
    for path, operations in schema["paths"].items():
        v1 = path.startswith("/v1/")
        for method, operation in operations.items():
            label, responses = f"{method.upper()} {path}", operation["responses"]
            # every route refuses a control character in a parameter (deps.plain_parameters); every
            # one but the health check needs a key; an id in the path may name nothing; a body may
            # not parse at all
            expected = {400 if v1 else 422} | ({401} if path != "/api/health" else set())
            expected |= {404} if "{" in path else set()
            expected |= {400} if "requestBody" in operation else set()
            errors = {int(status) for status in responses if status.isdigit() and int(status) >= 400}
            assert expected <= errors, (label, sorted(expected - errors))
            for status in errors:
                assert responses[str(status)]["content"] == (openai_error if v1 else error), (label, status)
    plan = schema["paths"]["/api/plan"]["post"]["responses"]
    assert {"400", "401", "404", "409", "422"} <= set(plan)
    assert "413" in schema["paths"]["/api/datasets"]["post"]["responses"]
    for stream in ("/api/jobs/{job_id}/stream", "/api/gpus/stream"):
        assert set(schema["paths"][stream]["get"]["responses"]["200"]["content"]) == {"text/event-stream"}


@pytest.mark.slow
def test_every_operation_holds_up_to_fuzzed_requests(app_and_key: tuple[object, str]) -> None:
    app, key = app_and_key
    outcomes = fuzz(app, key, examples=EXAMPLES)
    cases = sum(o.cases for o in outcomes)
    failures = [f"{o.operation} [{o.mode}, {o.ids} ids] {line}" for o in outcomes for line in o.failures]
    assert not failures, f"{len(failures)} failure(s) in {cases} cases:\n" + "\n".join(failures)
    # every operation was exercised, and the run is a few hundred cases
    assert {o.operation for o in outcomes if o.cases} == {o.operation for o in outcomes}
    assert cases >= 300, cases
    assert not any(s >= 500 for o in outcomes for s in o.statuses)
