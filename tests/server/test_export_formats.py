"""The API's export formats come from the registry (``engine.export.formats``): the download's
accepted values in the OpenAPI schema, the list the web UI reads, and the refusals, each naming
the field that chose the format."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from engine.export.formats import FORMATS, GGUF, VARIANTS
from server.settings import Settings
from tests.server.test_checkpoints import adapter_checkpoint
from tests.utils.jobs import start_job

DOWNLOAD = "/api/jobs/{job_id}/checkpoints/{step}/download"


def enum_of(schema: dict[str, Any], parameter: dict[str, Any]) -> list[str]:
    """The values a query parameter accepts (its enum, behind a $ref and an anyOf with null)."""
    found = parameter["schema"]
    for choice in found.get("anyOf", [found]):
        if "$ref" in choice:
            return list(schema["components"]["schemas"][choice["$ref"].rsplit("/", 1)[1]]["enum"])
        if "enum" in choice:
            return list(choice["enum"])
    raise AssertionError(f"no enum in {parameter}")


def test_the_download_s_values_in_the_schema_are_the_registry_s(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    parameters = {p["name"]: p for p in schema["paths"][DOWNLOAD]["get"]["parameters"]}
    assert enum_of(schema, parameters["format"]) == list(FORMATS)
    assert enum_of(schema, parameters["variant"]) == list(VARIANTS)
    assert enum_of(schema, parameters["gguf"]) == list(GGUF.variants)
    assert parameters["merged"]["deprecated"] and parameters["gguf"]["deprecated"]
    for name in FORMATS:  # each format described where /docs shows the field
        assert f"{name}: " in parameters["format"]["description"]


def test_the_formats_a_job_lists_and_which_are_refused(client: TestClient) -> None:
    rows = "".join(f'{{"text": "row {i}"}}\n' for i in range(8)).encode()
    dataset = client.post("/api/datasets", files={"file": ("rows.jsonl", rows)}).json()["id"]
    lora, full = start_job(client, dataset), start_job(client, dataset, method={"kind": "full"})
    listed = client.get(f"/api/jobs/{lora['id']}/checkpoints/formats")
    assert listed.status_code == 200, listed.text
    data = listed.json()["data"]
    assert [f["name"] for f in data] == list(FORMATS)
    assert [f["refused"] for f in data] == [None, None, None]  # the tiny Llama writes as GGUF too
    gguf = next(f for f in data if f["name"] == "gguf")
    assert (gguf["variants"], gguf["default_variant"]) == (list(GGUF.variants), GGUF.default_variant)
    later = client.get(f"/api/jobs/{full['id']}/checkpoints/formats").json()["data"]
    assert [f["refused"] for f in later] == [None, None, None]  # merged: per checkpoint, by its kind
    assert [f["adapter_only"] for f in later] == [False, True, False]
    assert client.get("/api/jobs/nope/checkpoints/formats").status_code == 404


def test_format_and_variant_download_as_the_shorthands_do(client: TestClient, settings: Settings) -> None:
    job_id, step = adapter_checkpoint(client, settings)
    url = DOWNLOAD.format(job_id=job_id, step=step)
    plain = client.get(url)
    named = client.get(url, params={"format": "checkpoint"})
    assert plain.status_code == named.status_code == 200, named.text
    assert named.content == plain.content and named.headers["content-disposition"].endswith('-adapter.tar"')

    def refused(params: dict[str, str]) -> tuple[int, str]:
        r = client.get(url, params=params)
        return r.status_code, r.json()["error"]["param"]

    assert refused({"format": "checkpoint", "variant": "q8_0"}) == (422, "variant")
    assert refused({"format": "merged", "variant": "f16"}) == (422, "variant")
    assert refused({"format": "gguf", "gguf": "q8_0"}) == (422, "gguf")
    assert refused({"gguf": "q8_0", "variant": "f16"}) == (422, "variant")
    assert refused({"format": "onnx"}) == (422, "format")
    assert refused({"variant": "q2_k"}) == (422, "variant")
