"""The service's wiring of image data: a job whose datasets name images gets ``data.image_store``
(through ``POST /api/jobs`` and ``POST /v1/fine_tuning/jobs``, whatever the request says), a worker
with a remote store pulls the images its datasets name, a preview through a vision-language
model's processor shows each row's images, and ``/v1/files`` fetches image URLs as the operator
allows and deletes a file's images with it."""

from __future__ import annotations

import base64
import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine import ConfigError
from server.app import create_app
from server.services import jobs, tokenizers
from server.settings import Settings
from server.storage import LocalStorage
from server.storage import images as store_images
from server.worker import files
from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.server.test_dataset_images import BLUE, RED, chat_row, image_server, images_stored, jsonl, sha
from tests.utils.jobs import job_body

__all__ = ["image_server"]  # a fixture used here

VLM = "tiny-vlm"


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite alone: nothing here differs by database."""
    return f"sqlite:///{tmp_path / 'roundhouse.db'}"


@pytest.fixture
def vlm(settings: Settings) -> Path:
    """A tiny Qwen2.5-VL base model in the service's models folder."""
    return tiny_vlm_folder(settings.models_dir / VLM, "qwen2_5_vl")


def archive(rows: list[dict[str, Any]], images: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("rows/train.jsonl", jsonl(rows))
        for name, data in images.items():
            zf.writestr(f"rows/{name}", data)
    return out.getvalue()


def upload(client: TestClient, name: str, content: bytes) -> dict[str, Any]:
    r = client.post("/api/datasets", files={"file": (name, content)})
    assert r.status_code == 201, r.text
    return dict(r.json())


def vision_set(client: TestClient) -> dict[str, Any]:
    rows = [chat_row("pics/red.png", "pics/blue.png"), chat_row("pics/red.png")]
    return upload(client, "pics.zip", archive(rows, {"pics/red.png": RED, "pics/blue.png": BLUE}))


def text_set(client: TestClient) -> dict[str, Any]:
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    return upload(client, "t.jsonl", jsonl(rows))


def test_a_job_on_image_data_gets_the_image_store_and_a_text_job_none(
    client: TestClient, settings: Settings, vlm: Path
) -> None:
    pictures, text = vision_set(client), text_set(client)
    store = str(settings.home.resolve() / "images")
    r = client.post("/api/jobs", json=job_body(pictures["id"], base_model=VLM))
    assert r.status_code == 201, r.text
    assert r.json()["config"]["data"]["image_store"] == store
    # images in the validation data alone are enough
    r = client.post(
        "/api/jobs", json=job_body(text["id"], base_model=VLM, validation_dataset_id=pictures["id"])
    )
    assert r.status_code == 201, r.text
    assert r.json()["config"]["data"]["image_store"] == store
    r = client.post("/api/jobs", json=job_body(text["id"]))
    assert r.status_code == 201, r.text
    assert r.json()["config"]["data"]["image_store"] is None
    # the store is the service's to name: a request cannot
    r = client.post("/api/jobs", json=job_body(pictures["id"], data={"image_store": "/elsewhere"}))
    assert r.status_code == 422 and "image_store" in r.text

    # the OpenAI fine-tuning API submits the same way
    r = client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": VLM,
            "training_file": f"file-{pictures['id']}",
            "roundhouse": {"hyper": {"max_steps": 2}},
        },
    )
    assert r.status_code == 200, r.text
    job = client.get(f"/api/jobs/{r.json()['id'].removeprefix('ftjob-')}").json()
    assert job["config"]["data"]["image_store"] == store


def test_build_config_sets_the_image_store_over_what_the_request_says(tmp_path: Path) -> None:
    def built(image_store: str | None) -> Any:
        return jobs.build_config(
            request={"base_model": "tiny", "data": {"image_store": "/elsewhere"}},
            model_path=tmp_path / "model",
            train_path="datasets/a/t.jsonl",
            validation_path=None,
            output_dir="runs/j1",
            home=tmp_path,
            image_store=image_store,
        ).data.image_store

    assert built("images") == "images"
    assert built(None) is None


class Remote(LocalStorage):
    """A store that is no folder of this host (as S3 is): everything is pulled from it."""

    def local_path(self, key: str) -> Path | None:
        return None


def stored_dataset(store: LocalStorage, folder: str, *images: bytes) -> str:
    """A dataset file in ``folder`` of the store, its manifest naming ``images`` (stored)."""
    key = f"{folder}/rows.jsonl"
    store.put_stream(key, io.BytesIO(b'{"text": "x"}\n'))
    store.put_stream(
        store_images.manifest_key(folder), io.BytesIO("".join(f"{sha(i)}\n" for i in images).encode())
    )
    for data in images:
        store.put_stream(store_images.image_key(sha(data)), io.BytesIO(data))
    return key


def test_a_worker_pulls_the_images_its_datasets_name_from_a_remote_store(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "worker", database_url="sqlite://")
    store = Remote(tmp_path / "bucket")
    other = png(7, 7, seed=9)
    train = stored_dataset(store, "datasets/a", RED)
    validation = stored_dataset(store, "datasets/b", BLUE)
    stored_dataset(store, "datasets/c", other)  # another dataset's image: not pulled
    config: dict[str, Any] = {
        "model": {"path": "demo", "name": "demo"},
        "data": {"train": train, "validation": validation, "image_store": "images"},
        "output_dir": "runs/j1",
    }
    raw = files.local_config(settings, store, config=config, base_model="demo")
    folder = settings.home.resolve() / "cache" / "images"
    assert raw["data"]["image_store"] == str(folder)
    assert raw["data"]["train"] == str(settings.home.resolve() / "cache" / train)
    pulled = sorted(p.name for p in folder.rglob("*") if p.is_file())
    assert pulled == sorted([sha(RED), sha(BLUE)])
    assert store_images.staged_path(folder, sha(RED)).read_bytes() == RED
    assert config["data"]["image_store"] == "images"  # the row keeps its key

    # an image the manifest names that the store lost: refused naming the field and the image
    (tmp_path / "bucket" / store_images.image_key(sha(RED))).unlink()
    (folder / sha(RED)[:2] / sha(RED)).unlink()
    with pytest.raises(ConfigError) as lost:
        files.local_config(settings, store, config=config, base_model="demo")
    assert lost.value.field == "data.image_store" and sha(RED) in str(lost.value)

    # the API host's own folder (a path) is used as it is; a text job has none
    own = {**config, "data": {**config["data"], "image_store": str(tmp_path / "bucket" / "images")}}
    assert files.local_config(settings, store, config=own, base_model="demo")["data"]["image_store"] == str(
        tmp_path / "bucket" / "images"
    )
    text = {**config, "data": {"train": train, "image_store": None}}
    assert files.local_config(settings, store, config=text, base_model="demo")["data"]["image_store"] is None


def test_a_preview_through_a_vlm_shows_each_row_s_images(
    client: TestClient, settings: Settings, vlm: Path
) -> None:
    pictures = vision_set(client)
    r = client.get(f"/api/datasets/{pictures['id']}/preview", params={"model": VLM, "max_length": 4096})
    assert r.status_code == 200, r.text
    rows = r.json()["rows"]
    assert [len(row["images"]) for row in rows] == [2, 1]
    assert all(url.startswith("data:image/jpeg;base64,") for row in rows for url in row["images"])
    assert sum(t["trained"] for t in rows[0]["tokens"]) > 0
    r = client.get(f"/api/datasets/{pictures['id']}/stats", params={"model": VLM, "max_length": 4096})
    assert r.status_code == 200, r.text
    # the text model cannot render the images; a text row through the VLM has none
    r = client.get(f"/api/datasets/{pictures['id']}/preview", params={"model": "tiny"})
    assert r.status_code == 422 and r.json()["error"]["param"] == "model"
    text = text_set(client)
    r = client.get(f"/api/datasets/{text['id']}/preview", params={"model": VLM})
    assert r.status_code == 200 and r.json()["rows"][0]["images"] is None


def test_of_model_gives_a_vlm_its_processor_and_refuses_an_unsupported_one(
    settings: Settings, vlm: Path
) -> None:
    processor = tokenizers.of_model(VLM, models_dir=settings.models_dir, hf_cache=None)
    assert processor.image_processor is not None and processor.tokenizer is not None
    assert tokenizers.of_model(VLM, models_dir=settings.models_dir, hf_cache=None) is processor  # kept
    text = tokenizers.of_model("tiny", models_dir=settings.models_dir, hf_cache=None)
    assert getattr(text, "image_processor", None) is None
    assert tokenizers.load(vlm) is not processor  # the planner counts with the text tokenizer

    refused = settings.models_dir / "gemma-3n"
    refused.mkdir()
    config = json.loads((vlm / "config.json").read_text())
    (refused / "config.json").write_text(
        json.dumps({**config, "architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n"})
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (refused / name).write_bytes((vlm / name).read_bytes())
    from server.services.failures import Invalid

    with pytest.raises(Invalid) as info:
        tokenizers.of_model("gemma-3n", models_dir=settings.models_dir, hf_cache=None)
    assert info.value.param == "model" and "Gemma 3n" in info.value.message


def test_v1_files_fetch_image_urls_as_the_operator_allows_and_delete_their_images(
    client: TestClient, settings: Settings, image_server: str
) -> None:
    rows = jsonl(
        [
            chat_row("data:image/png;base64," + base64.b64encode(BLUE).decode()),
            chat_row(f"{image_server}/red.png"),
        ]
    )

    def post(c: TestClient) -> Any:
        return c.post("/v1/files", files={"file": ("web.jsonl", rows)}, data={"purpose": "fine-tune"})

    r = post(client)
    assert r.status_code == 400 and "ROUNDHOUSE_ALLOW_IMAGE_URLS=1" in r.text  # as OpenAI refuses
    assert images_stored(settings) == []
    allowed = create_app(settings.model_copy(update={"allow_image_urls": True}))
    with TestClient(allowed) as fetching:  # type: ignore[arg-type]
        fetching.headers["Authorization"] = client.headers["Authorization"]  # the same database
        r = post(fetching)
    assert r.status_code == 200, r.text
    assert images_stored(settings) == sorted([sha(RED), sha(BLUE)])
    r = client.delete(f"/v1/files/{r.json()['id']}")
    assert r.status_code == 200, r.text
    assert images_stored(settings) == []
