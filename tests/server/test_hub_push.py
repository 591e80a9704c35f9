"""Checkpoint pushes to a local server that speaks the Hub's API (``tests/utils/fake_hub.py``),
through the real ``huggingface_hub`` client run by a real worker: the repo created, the adapter's
weights uploaded by Git LFS and the rest in one NDJSON commit, the model card's metadata and
sections read back, the pushed adapter loaded with ``PeftModel``; a merged push by the CLI
(``--format merged``) and by the deprecated ``merged: true``; a GGUF push (q8_0), the files a GGUF
download holds with a card that says so; a token without write access refused with the setting
named; unknown jobs and steps, a missing token, and a format the checkpoint cannot take (naming
``format``, ``variant`` or ``merged``) refused at once."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from server.app import create_app
from tests.engine.tiny import tiny_model_folder
from tests.server.conftest import WorkerProcess
from tests.server.test_hub_models import TOKEN, api, progress_events, settings_for
from tests.server.test_worker import dataset
from tests.utils import child_env, roundhouse
from tests.utils.fake_hub import FakeHub
from tests.utils.jobs import start_job, wait_for, wait_for_job

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub(token=TOKEN).start()
    yield fake
    fake.stop()


def read_back(hub: FakeHub, repo_id: str, into: Path) -> dict[str, bytes]:
    """The repo's files as the Hub serves them (its file list, then each file), written to ``into``."""
    with httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        info = http.get(f"/api/models/{repo_id}")
        assert info.status_code == 200, info.text
        files = {}
        for sibling in info.json()["siblings"]:
            r = http.get(f"/{repo_id}/resolve/main/{sibling['rfilename']}")
            assert r.status_code == 200 and len(r.content) == sibling["size"], sibling
            files[sibling["rfilename"]] = r.content
            (into / sibling["rfilename"]).parent.mkdir(parents=True, exist_ok=True)
            (into / sibling["rfilename"]).write_bytes(r.content)
    return files


def card_of(files: dict[str, bytes]) -> tuple[dict[str, Any], str]:
    text = files["README.md"].decode()
    assert text.startswith("---\n"), text[:200]
    _, meta, body = text.split("---\n", 2)
    return yaml.safe_load(meta), body


def checkpoint_files(client: TestClient, job_id: str, step: int, **params: str) -> dict[str, bytes]:
    r = client.get(f"/api/jobs/{job_id}/checkpoints/{step}/download", params=params)
    assert r.status_code == 200, r.text[:300]
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        return {
            m.name.split("/", 1)[1]: tar.extractfile(m).read()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


def test_a_push_is_refused_at_once_without_a_job_a_step_or_a_token(tmp_path: Path, hub: FakeHub) -> None:
    settings = settings_for(tmp_path, hub)
    tiny_model_folder(settings.models_dir / "tiny")
    with api(settings) as client:
        r = client.post("/api/jobs/nope/checkpoints/2/push", json={"repo_id": "me/x"})
        assert r.status_code == 404, r.text
        job = start_job(client, dataset(client), base_model="tiny")
        r = client.post(f"/api/jobs/{job['id']}/checkpoints/7/push", json={"repo_id": "me/x"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "step", r.text
        r = client.post(f"/api/jobs/{job['id']}/checkpoints/7/push", json={"repo_id": "not a repo"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "repo_id", r.text
        key = client.headers["Authorization"]
    with TestClient(create_app(settings.model_copy(update={"hub_token": None}))) as client:
        client.headers["Authorization"] = key
        r = client.post(f"/api/jobs/{job['id']}/checkpoints/2/push", json={"repo_id": "me/x"})
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "hub_token_required"
        assert "ROUNDHOUSE_HUB_TOKEN" in r.json()["error"]["message"]
    assert hub.created == []


def recorded_checkpoint(client: TestClient, job: dict[str, Any], *, kind: str, step: int = 2) -> None:
    """A checkpoint of ``kind`` on the job, recorded as the worker records it (a folder with no
    weights: the pushes below are refused before anything reads it)."""
    from server.services import checkpoints

    folder = Path(job["config"]["output_dir"]) / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        checkpoints.record(session, job_id=job["id"], step=step, path=str(folder), kind=kind, metrics={})


def test_a_format_the_checkpoint_cannot_take_is_refused_before_anything_is_sent(
    tmp_path: Path, hub: FakeHub
) -> None:
    settings = settings_for(tmp_path, hub)
    tiny_model_folder(settings.models_dir / "tiny")
    tiny_model_folder(settings.models_dir / "tiny-moe", "qwen3_moe")  # a family GGUF cannot write
    with api(settings) as client:
        data = dataset(client)
        full = start_job(client, data, base_model="tiny", method={"kind": "full"})
        lora = start_job(client, data, base_model="tiny")
        moe = start_job(client, data, base_model="tiny-moe")
        recorded_checkpoint(client, full, kind="full")
        recorded_checkpoint(client, lora, kind="adapter")
        recorded_checkpoint(client, moe, kind="adapter")

        def refused(job: dict[str, Any], body: dict[str, Any]) -> tuple[int, str | None, str]:
            r = client.post(f"/api/jobs/{job['id']}/checkpoints/2/push", json={"repo_id": "me/x"} | body)
            return r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]

        status, param, message = refused(full, {"format": "merged"})
        assert (status, param) == (422, "format") and "only a LoRA adapter can be merged" in message, message
        # the deprecated merged=true is format=merged, and is refused so too
        assert refused(full, {"merged": True})[:2] == (422, "format")
        status, param, message = refused(moe, {"format": "gguf"})
        assert (status, param) == (422, "format"), message
        assert "Qwen3MoeForCausalLM cannot be exported yet" in message, message
        status, param, message = refused(lora, {"format": "gguf", "variant": "q2_k"})
        assert (status, param) == (422, "variant") and "q8_0" in message, message  # the variants named
        assert refused(lora, {"format": "merged", "variant": "q8_0"})[:2] == (422, "variant")
        status, param, message = refused(lora, {"format": "onnx"})
        assert (status, param) == (422, "format") and "gguf" in message, message
        # merged=true beside another format: one of the two, named
        status, param, message = refused(lora, {"merged": True, "format": "gguf"})
        assert (status, param) == (422, "merged") and "format=gguf" in message, message
        assert client.get("/api/transfers", params={"kind": "push"}).json()["data"] == []

        # the formats it can take are queued, the legacy merged=true as format=merged
        queued = {}
        for repo, body in [
            ("me/a", {}),
            ("me/m", {"merged": True}),
            ("me/g", {"format": "gguf", "variant": "q4_k_m"}),
            ("me/d", {"format": "gguf"}),
        ]:
            r = client.post(f"/api/jobs/{lora['id']}/checkpoints/2/push", json={"repo_id": repo} | body)
            assert r.status_code == 202, r.text
            queued[repo] = (r.json()["options"]["format"], r.json()["options"]["variant"])
        assert queued == {
            "me/a": ("checkpoint", None),
            "me/m": ("merged", None),
            "me/g": ("gguf", "q4_k_m"),
            "me/d": ("gguf", "q8_0"),  # the format's default variant
        }
    assert hub.created == []


def test_the_push_s_formats_in_the_schema_are_the_registry_s(tmp_path: Path, hub: FakeHub) -> None:
    from engine.export import FORMATS, formats_help

    with api(settings_for(tmp_path, hub)) as client:
        schema = client.get("/openapi.json").json()
    body = schema["paths"]["/api/jobs/{job_id}/checkpoints/{step}/push"]["post"]["requestBody"]
    push = schema["components"]["schemas"][
        body["content"]["application/json"]["schema"]["$ref"].rsplit("/")[-1]
    ]
    fields = push["properties"]
    named = schema["components"]["schemas"][fields["format"]["$ref"].rsplit("/")[-1]]
    assert named["enum"] == list(FORMATS) and fields["format"]["default"] == "checkpoint"
    assert fields["format"]["description"] == formats_help()
    assert fields["merged"]["deprecated"] and "format" in fields["merged"]["description"]


@pytest.mark.slow
def test_push_round_trip_with_a_real_worker(tmp_path: Path, hub: FakeHub) -> None:
    settings = settings_for(tmp_path, hub, hub_xet=False)
    tiny_model_folder(settings.models_dir / "tiny")
    with api(settings) as client:
        worker = WorkerProcess(settings, tmp_path / "worker.log").start()
        try:
            job = start_job(client, dataset(client), base_model="tiny")
            wait_for_job(client, job["id"], {"succeeded"}, timeout=TIMEOUT_S, logs=[worker])
            url = f"/api/jobs/{job['id']}/checkpoints/2/push"

            # a token that may read but not write: the push fails, naming the setting
            hub.token_writes = False
            r = client.post(url, json={"repo_id": "me/tiny-lora", "private": True})
            assert r.status_code == 202, r.text
            get = lambda: client.get(f"/api/transfers/{r.json()['id']}").json()  # noqa: E731
            failed = wait_for(get, until={"failed"}, fail_on={"succeeded"}, timeout=60, details=worker.tail)
            assert failed["error_code"] == "hub_forbidden", failed
            assert "HTTP 403" in failed["error"] and "ROUNDHOUSE_HUB_TOKEN" in failed["error"], failed
            hub.token_writes = True

            push = client.post(url, json={"repo_id": "me/tiny-lora", "private": True})
            assert push.status_code == 202, push.text
            assert push.json()["kind"] == "push" and push.json()["options"]["step"] == 2
            events = progress_events(client, push.json()["id"])
            final = events[-1]
            assert final["status"] == "succeeded", (final["error"], worker.tail())
            done = [e["bytes_done"] for e in events]
            assert done == sorted(done) and done[-1] == final["bytes_total"] > 0, done
            assert final["target"].endswith("/me/tiny-lora")
            assert hub.created[-1]["visibility"] == "private" and hub.repos[("model", "me/tiny-lora")].private

            files = read_back(hub, "me/tiny-lora", tmp_path / "pushed")
            assert sorted(files) == sorted(final["files"])
            assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(files)
            assert not any(name.startswith(("state/", "evaluations/")) for name in files)
            assert hub.received["lfs"] >= len(files["adapter_model.safetensors"])  # weights went by LFS
            ours = checkpoint_files(client, job["id"], 2)
            assert files["adapter_model.safetensors"] == ours["adapter_model.safetensors"]

            meta, body = card_of(files)
            assert meta["base_model"] == "tiny" and meta["library_name"] == "peft"
            assert {"peft", "lora", "roundhouse"} <= set(meta["tags"]) and meta["pipeline_tag"]
            assert "| learning_rate | 0.01 |" in body and "| max_steps | 2 |" in body
            assert "loss/train" in body and "PeftModel.from_pretrained" in body and '"me/tiny-lora"' in body

            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(settings.models_dir / "tiny")
            model = PeftModel.from_pretrained(base, tmp_path / "pushed")
            trained = [p for n, p in model.named_parameters() if "lora_B" in n]
            assert trained and any(bool(p.abs().sum() > 0) for p in trained)

            # the adapter merged into its base, pushed by the CLI: a plain transformers model
            done = subprocess.run(
                roundhouse("checkpoints", "push", job["id"], "2", "me/tiny-merged", "--format", "merged"),
                env=child_env(**settings.child_environment()),
                capture_output=True,
                text=True,
                timeout=150,
            )
            assert done.returncode == 0, (done.stdout, done.stderr, worker.tail())
            assert "succeeded" in done.stdout and "/me/tiny-merged (commit " in done.stdout, done.stdout
            files = read_back(hub, "me/tiny-merged", tmp_path / "merged")
            assert "config.json" in files and "adapter_config.json" not in files
            assert any(n.endswith(".safetensors") for n in files)
            meta, body = card_of(files)
            assert meta["library_name"] == "transformers" and meta["base_model"] == "tiny"
            assert 'AutoModelForCausalLM.from_pretrained("me/tiny-merged")' in body
            AutoModelForCausalLM.from_pretrained(tmp_path / "merged")

            # the deprecated merged=true: the same merged model
            legacy = client.post(url, json={"repo_id": "me/tiny-legacy", "merged": True})
            assert legacy.status_code == 202 and legacy.json()["options"]["format"] == "merged", legacy.text
            final = progress_events(client, legacy.json()["id"])[-1]
            assert final["status"] == "succeeded", (final["error"], worker.tail())
            again = read_back(hub, "me/tiny-legacy", tmp_path / "legacy")
            assert sorted(again) == sorted(files) and again["config.json"] == files["config.json"]

            # a GGUF in q8_0: the folder a download of the same format holds, with a GGUF's card
            gguf = client.post(url, json={"repo_id": "me/tiny-gguf", "format": "gguf", "variant": "q8_0"})
            assert gguf.status_code == 202, gguf.text
            final = progress_events(client, gguf.json()["id"])[-1]
            assert final["status"] == "succeeded", (final["error"], worker.tail())
            files = read_back(hub, "me/tiny-gguf", tmp_path / "gguf")
            assert sorted(files) == ["Modelfile", "README.md", "adapter-f32.gguf", "model-q8_0.gguf"]
            assert files["model-q8_0.gguf"][:4] == b"GGUF" and hub.received["lfs"] >= len(
                files["model-q8_0.gguf"]
            )
            assert "FROM ./model-q8_0.gguf" in files["Modelfile"].decode()
            ours = checkpoint_files(client, job["id"], 2, format="gguf", variant="q8_0")
            assert files["model-q8_0.gguf"] == ours["model-q8_0.gguf"]
            assert files["adapter-f32.gguf"] == ours["adapter-f32.gguf"]
            meta, body = card_of(files)
            assert meta["library_name"] == "gguf" and meta["base_model"] == "tiny"
            assert {"gguf", "q8_0", "roundhouse"} <= set(meta["tags"]), meta
            assert "a GGUF (q8_0) for llama.cpp and Ollama" in body
            assert "hf download me/tiny-gguf" in body and "tiny-gguf/model-q8_0.gguf" in body
            assert "--lora tiny-gguf/adapter-f32.gguf" in body and "ollama create" in body

            # --merged (hidden, deprecated) is --format merged: beside another format it is refused
            both = subprocess.run(
                roundhouse("checkpoints", "push", job["id"], "2", "me/x", "--merged", "--format", "gguf"),
                env=child_env(**settings.child_environment()),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert both.returncode == 2 and "--format gguf" in both.stderr, (both.stdout, both.stderr)
            listed = client.get("/api/transfers", params={"kind": "push"}).json()["data"]
            assert [t["status"] for t in listed] == ["succeeded"] * 4 + ["failed"]
            assert [t["options"]["format"] for t in listed] == ["gguf", "merged", "merged"] + [
                "checkpoint"
            ] * 2
            assert json.loads(json.dumps(listed))  # the listing is plain JSON
        finally:
            hub.token_writes = True
            worker.end()
