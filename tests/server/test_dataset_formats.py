"""The service's data formats are the engine's registry: its listing, its schema's ``data.format``
and its upload validation all read it, so a format registered in the engine is one the service
stores and previews with no change of its own."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from engine.data.formats import base as registry
from engine.data.formats import family_of, format_names, register
from tests.engine.data.test_formats import QuestionAnswer


def test_the_formats_listing_is_the_registry(client: TestClient) -> None:
    r = client.get("/api/datasets/formats")
    assert r.status_code == 200, r.text
    listed = r.json()["data"]
    assert [f["name"] for f in listed] == list(format_names())
    assert all(f["family"] == family_of(f["name"]) and f["description"] for f in listed)
    by_name = {f["name"]: f for f in listed}
    assert by_name["preference"]["measures"] == "both answers of each pair"


def test_the_formats_schema_names_the_registrys_families(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    families = schemas["DataFormatPublic"]["properties"]["family"]["enum"]
    assert set(families) == {family_of(n) for n in format_names()}


# server/schemas.py's DataOptions.format still spells the names out as a Literal, without "kto";
# it becomes ``format: FormatChoice = "auto"`` (engine.data.formats), and this test then passes
def test_the_job_schema_names_the_registrys_formats(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["DataOptions"]["properties"]["format"]["enum"] == ["auto", *format_names()]


def test_a_kto_file_is_stored_as_such_and_previewed(client: TestClient) -> None:
    rows = [
        {"prompt": "one plus one?", "completion": "two", "label": True},
        {"prompt": [{"role": "user", "content": "two plus two?"}], "completion": "five", "label": False},
    ]
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = client.post("/api/datasets", files={"file": ("kto.jsonl", content)})
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["format"], ds["rows"]) == ("kto", 2)
    preview = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny"}).json()["rows"]
    trained = ["".join(t["text"] for t in row["tokens"] if t["trained"]) for row in preview]
    assert trained[0].startswith("two") and trained[1].startswith("five")
    stats = client.get(f"/api/datasets/{ds['id']}/stats", params={"model": "tiny"}).json()
    assert stats["sampled"] == 2 and sum(b["count"] for b in stats["histogram"]) == 2
    bad = content + json.dumps({"prompt": "p", "completion": "c", "label": "false"}).encode() + b"\n"
    r = client.post("/api/datasets", files={"file": ("bad.jsonl", bad)})
    assert r.status_code == 422 and r.json()["error"]["details"][0]["line"] == 3, r.text
    assert "field 'label' must be a JSON boolean" in r.json()["error"]["details"][0]["message"]


def test_an_upload_is_validated_by_whatever_the_registry_holds(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    register(QuestionAnswer())
    assert [f["name"] for f in client.get("/api/datasets/formats").json()["data"]][-1] == "qa"
    rows = [{"question": "one plus one?", "answer": "two"}, {"question": "two plus two?", "answer": "four"}]
    content = "".join(json.dumps(r) + "\n" for r in rows).encode()
    r = client.post("/api/datasets", files={"file": ("qa.jsonl", content)})
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["format"], ds["rows"]) == ("qa", 2)
    preview = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny"}).json()["rows"]
    trained = "".join(t["text"] for t in preview[0]["tokens"] if t["trained"])
    assert trained.startswith("two") and "one plus one" not in trained
    # a row the format refuses is named by line and field
    bad = content + json.dumps({"question": "three?"}).encode() + b"\n"
    r = client.post("/api/datasets", files={"file": ("bad.jsonl", bad)})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["details"] == [{"line": 3, "unit": "line", "message": "missing field 'answer'"}]
