"""Datasets with images through ``POST /api/datasets``: zip and tar archives of a data file and its
images, Parquet with image bytes, data URLs; each image stored once, content-addressed, and the
stored rows naming it ``sha256:<hex>``; bad archives and references refused naming the member or
the line and field, losing nothing stored; a delete leaves no image unused; previews show
thumbnails; a job on such a dataset gets ``data.image_store``."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engine.model.loading import load_processor_for
from server.app import create_app
from server.services import datasets
from server.settings import Settings
from server.storage import LocalStorage, open_storage
from server.storage import images as store_images
from tests.engine.tiny_vision import png, tiny_vlm_folder
from tests.server.test_storage import s3_app
from tests.utils.s3 import S3Server, s3_server, s3_settings

__all__ = ["s3_server", "s3_settings"]  # fixtures used here

RED, BLUE, GREEN = png(12, 8, seed=1), png(9, 14, seed=2), png(10, 10, seed=3)


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    """SQLite alone: nothing here differs by database (test_datasets.py covers both)."""
    return f"sqlite:///{tmp_path / 'roundhouse.db'}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chat_row(*images: str, answer: str = "colours") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What colour is this?"}]
    parts += [{"type": "image_url", "image_url": {"url": ref}} for ref in images]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def human(text: str) -> dict[str, str]:
    return {"from": "human", "value": text}


def gpt(text: str) -> dict[str, str]:
    return {"from": "gpt", "value": text}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def plain(name: str) -> zipfile.ZipInfo:
    """A zip member marked a plain file, as zip(1) marks it."""
    info = zipfile.ZipInfo(name)
    info.external_attr = 0o100644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def zipped(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(plain(name), data)
    return out.getvalue()


def tarred(files: dict[str, bytes], *, links: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tf.addfile(info)
    return out.getvalue()


def upload(client: TestClient, name: str, content: bytes) -> Any:
    return client.post("/api/datasets", files={"file": (name, content)})


def images_stored(settings: Settings) -> list[str]:
    folder = settings.home / "images"
    return sorted(p.name for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def stored_rows(settings: Settings, dataset: dict[str, Any]) -> list[dict[str, Any]]:
    path = settings.home / "datasets" / dataset["id"] / dataset["filename"]
    return [json.loads(line) for line in path.read_text().splitlines()]


def scratch_left(settings: Settings) -> list[str]:
    folder = settings.cache_dir / "incoming"
    return sorted(p.name for p in folder.iterdir() if p.name != ".images.lock") if folder.exists() else []


def test_a_zip_of_rows_and_images_stores_each_image_once(client: TestClient, settings: Settings) -> None:
    rows = [
        chat_row("images/red.png"),
        chat_row("images/red.png", "images/blue.png"),
        chat_row("images/red.png"),
    ]
    archive = zipped({"set/train.jsonl": jsonl(rows), "set/images/red.png": RED, "set/images/blue.png": BLUE})
    r = upload(client, "colours.zip", archive)
    assert r.status_code == 201, r.text
    dataset = r.json()
    assert (dataset["name"], dataset["filename"], dataset["format"], dataset["rows"]) == (
        "colours.zip",
        "train.jsonl",
        "chat",
        3,
    )
    assert images_stored(settings) == sorted([sha(RED), sha(BLUE)])
    assert (settings.home / "images" / sha(RED)[:2] / sha(RED)).read_bytes() == RED
    urls = [
        [p["image_url"]["url"] for p in row["messages"][0]["content"][1:]]
        for row in stored_rows(settings, dataset)
    ]
    assert urls == [
        [f"sha256:{sha(RED)}"],
        [f"sha256:{sha(RED)}", f"sha256:{sha(BLUE)}"],
        [f"sha256:{sha(RED)}"],
    ]
    assert scratch_left(settings) == []
    manifest = settings.home / "datasets" / dataset["id"] / "images.txt"
    assert manifest.read_text().split() == sorted([sha(RED), sha(BLUE)])


def test_a_delete_removes_the_images_no_other_dataset_names(client: TestClient, settings: Settings) -> None:
    first = upload(
        client, "a.zip", zipped({"a.jsonl": jsonl([chat_row("r.png", "b.png")]), "r.png": RED, "b.png": BLUE})
    ).json()
    data_url = "data:image/png;base64," + base64.b64encode(RED).decode()
    r = upload(client, "b.jsonl", jsonl([chat_row(data_url), chat_row(f"sha256:{sha(BLUE)}")]))
    assert r.status_code == 201, r.text
    second = r.json()
    assert images_stored(settings) == sorted([sha(RED), sha(BLUE)])  # the same bytes: stored once
    assert client.delete(f"/api/datasets/{first['id']}").status_code == 204
    assert images_stored(settings) == sorted([sha(RED), sha(BLUE)])  # the second names both
    assert client.delete(f"/api/datasets/{second['id']}").status_code == 204
    assert images_stored(settings) == []
    assert sorted(p.name for p in (settings.home / "datasets").iterdir()) == []


def test_a_tar_gz_of_sharegpt_rows_and_a_parquet_of_image_bytes(
    client: TestClient, settings: Settings
) -> None:
    rows = [
        {"conversations": [human("<image>Name it."), gpt("red")], "images": ["pics/red.png"]},
        {
            "conversations": [human("<image><image>Both?"), gpt("two")],
            "images": ["pics/red.png", "pics/green.png"],
        },
    ]
    r = upload(
        client,
        "llava.tar.gz",
        tarred({"data.jsonl": jsonl(rows), "pics/red.png": RED, "pics/green.png": GREEN}),
    )
    assert r.status_code == 201, r.text
    assert r.json()["format"] == "sharegpt"
    assert [row["images"] for row in stored_rows(settings, r.json())] == [
        [f"sha256:{sha(RED)}"],
        [f"sha256:{sha(RED)}", f"sha256:{sha(GREEN)}"],
    ]
    table = pa.table(
        {
            "messages": [
                [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "blue"}]
            ],
            "images": [[{"bytes": BLUE, "path": "blue.png"}]],
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    r = upload(client, "hf.parquet", out.getvalue())
    assert r.status_code == 201, r.text
    stored = settings.home / "datasets" / r.json()["id"] / "hf.parquet"
    assert pq.read_table(stored).column("images").to_pylist() == [[f"sha256:{sha(BLUE)}"]]
    assert images_stored(settings) == sorted([sha(RED), sha(GREEN), sha(BLUE)])


def bomb(members: int, size: int) -> bytes:
    """A zip of ``members`` members of ``size`` zero bytes each: a few kB that unpack to much more."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr(plain("t.jsonl"), jsonl([chat_row("a0.png")]))
        for k in range(members):
            with zf.open(plain(f"a{k}.png"), "w") as member:
                member.write(bytes(size))
    return out.getvalue()


ROW = jsonl([chat_row("a.png")])
MISSING = jsonl([chat_row("a.png"), chat_row("gone.png")])
BAD_ARCHIVES = {
    "traversal": ("x.zip", lambda: zipped({"t.jsonl": ROW, "../evil.png": RED}), "'..'"),
    "absolute": ("x.zip", lambda: zipped({"t.jsonl": ROW, "/etc/evil.png": RED}), "absolute"),
    "link": ("x.tar.gz", lambda: tarred({"t.jsonl": ROW}, links={"a.png": "/etc/passwd"}), "link"),
    "no data file": ("x.zip", lambda: zipped({"a.png": RED}), "no data file"),
    "two data files": ("x.zip", lambda: zipped({"a.jsonl": b"", "b.csv": b""}), "2 data files"),
    # the test's upload limit is 200 kB: an archive may unpack to 4 x that
    "bomb": ("x.zip", lambda: bomb(6, 190_000), "the archive unpacks to more than 800000 bytes"),
    "not a zip": ("x.zip", lambda: b"PK\x03\x04 not really", "not a readable zip"),
    "not a tar.gz": ("x.tar.gz", lambda: b"\x1f\x8b\x08 broken", "not a readable"),
    "missing image": (
        "x.zip",
        lambda: zipped({"t.jsonl": MISSING, "a.png": RED}),
        "line 2: messages[0].content[1].image_url.url: 'gone.png': no such file",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
def test_a_bad_archive_is_refused_naming_why_and_nothing_stored_is_lost(
    client: TestClient, settings: Settings, case: str
) -> None:
    kept = upload(client, "kept.zip", zipped({"k.jsonl": jsonl([chat_row("k.png")]), "k.png": GREEN})).json()
    name, build, says = BAD_ARCHIVES[case]
    r = upload(client, name, build())
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    assert error["param"] == "file" and says in error["message"], error
    assert str(settings.home) not in r.text and ".incoming-" not in r.text
    assert images_stored(settings) == [sha(GREEN)]
    assert sorted(p.name for p in (settings.home / "datasets").iterdir()) == [kept["id"]]
    assert scratch_left(settings) == []
    assert client.get(f"/api/datasets/{kept['id']}").status_code == 200


class Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = RED if self.path == "/red.png" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_image_url_is_refused_unless_the_operator_allows_fetching(
    client: TestClient, settings: Settings, image_server: str
) -> None:
    rows = jsonl(
        [
            chat_row("data:image/png;base64," + base64.b64encode(BLUE).decode()),
            chat_row(f"{image_server}/red.png"),
        ]
    )
    r = upload(client, "web.jsonl", rows)
    assert r.status_code == 422
    detail = r.json()["error"]["details"]
    assert [d["line"] for d in detail] == [2] and "ROUNDHOUSE_ALLOW_IMAGE_URLS=1" in detail[0]["message"]
    assert "messages[0].content[1].image_url.url" in detail[0]["message"]
    assert images_stored(settings) == []

    allowed = settings.model_copy(update={"allow_image_urls": True})
    app = create_app(allowed)
    with TestClient(app) as fetching:  # type: ignore[arg-type]
        fetching.headers["Authorization"] = client.headers["Authorization"]  # the same database
        r = upload(fetching, "web.jsonl", rows)
        assert r.status_code == 201, r.text
        assert images_stored(settings) == sorted([sha(RED), sha(BLUE)])
        r = upload(fetching, "gone.jsonl", jsonl([chat_row(f"{image_server}/gone.png")]))
        assert r.status_code == 422 and "HTTP 404" in r.json()["error"]["details"][0]["message"]


def test_a_job_on_an_image_dataset_gets_the_image_store_and_a_text_one_none(
    client: TestClient, settings: Settings
) -> None:
    with_images = upload(
        client, "i.zip", zipped({"i.jsonl": jsonl([chat_row("a.png")]), "a.png": RED})
    ).json()
    text = upload(client, "t.jsonl", b'{"text": "plain words"}\n').json()
    storage = open_storage(settings)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        image_set = datasets.get_dataset(session, dataset_id=with_images["id"])
        text_set = datasets.get_dataset(session, dataset_id=text["id"])
        assert datasets.image_store(storage, image_set) == str(settings.home.resolve() / "images")
        assert datasets.image_store(storage, text_set, None) is None
        assert datasets.image_store(storage, text_set, image_set) is not None


def test_a_preview_shows_a_thumbnail_of_each_image_beside_its_row(
    client: TestClient, settings: Settings, tmp_path: Path
) -> None:
    text_row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    big = png(300, 200, seed=4)
    rows = [chat_row("a.png", "b.png"), text_row, chat_row("big.png")]
    archive = zipped({"p.jsonl": jsonl(rows), "a.png": RED, "b.png": BLUE, "big.png": big})
    dataset = upload(client, "p.zip", archive).json()
    r = client.get(f"/api/datasets/{dataset['id']}/preview", params={"model": "tiny"})
    assert r.status_code == 422, r.text  # a text model renders no image
    error = r.json()["error"]
    assert error["param"] == "model" and "'tiny'" in error["message"] and "line 1" in error["message"]

    processor = load_processor_for(tiny_vlm_folder(tmp_path / "vlm", "qwen2_5_vl"))
    storage = open_storage(settings)
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        found = datasets.get_dataset(session, dataset_id=dataset["id"])
        assert found is not None
        file = datasets.local_file(storage, found, cache=settings.cache_dir)
        images_dir = datasets.local_images(storage, found, cache=settings.cache_dir)
        previewed = datasets.preview(
            found, file=file, tokenizer=processor, limit=5, max_length=4096, images_dir=images_dir
        )
    assert [len(row.get("images") or []) for row in previewed] == [2, 0, 1]
    thumbs = [*previewed[0]["images"], *previewed[2]["images"]]
    assert all(t.startswith("data:image/jpeg;base64,") for t in thumbs)
    sizes = [Image.open(io.BytesIO(base64.b64decode(t.split(",", 1)[1]))).size for t in thumbs]
    assert sizes[:2] == [(12, 8), (9, 14)]  # smaller than a thumbnail: as they are
    assert max(sizes[2]) < 300 and sizes[2][0] == round(sizes[2][1] * 1.5)  # the 300 x 200 one, smaller
    assert any(t["trained"] for t in previewed[0]["tokens"])

    text = upload(client, "t.jsonl", b'{"text": "plain words"}\n').json()
    r = client.get(f"/api/datasets/{text['id']}/preview", params={"model": "tiny"})
    assert r.status_code == 200 and r.json()["rows"][0]["images"] is None


def test_a_store_failing_midway_takes_its_images_back(client: TestClient, settings: Settings) -> None:
    class Failing(LocalStorage):
        def put_file(self, key: str, path: Path) -> None:
            if key.startswith("datasets/") and key.endswith(".jsonl"):
                raise OSError(28, "No space left on device", key)
            super().put_file(key, path)

    kept = upload(client, "k.zip", zipped({"k.jsonl": jsonl([chat_row("k.png")]), "k.png": GREEN})).json()
    archive = zipped({"t.jsonl": jsonl([chat_row("r.png", "k.png")]), "r.png": RED, "k.png": GREEN})
    with client.app.state.sessions() as session, pytest.raises(OSError, match="No space left"):  # type: ignore[attr-defined]
        datasets.store_upload(
            session,
            source=io.BytesIO(archive),
            filename="t.zip",
            name=None,
            storage=Failing(settings.home),
            scratch=settings.cache_dir / "incoming",
            max_bytes=settings.max_upload_bytes,
        )
    assert images_stored(settings) == [sha(GREEN)]  # red went; green, which the kept dataset names, stays
    assert sorted(p.name for p in (settings.home / "datasets").iterdir()) == [kept["id"]]
    assert scratch_left(settings) == []


def test_the_start_sweeps_what_an_upload_cut_short_left(client: TestClient, settings: Settings) -> None:
    kept = upload(client, "k.zip", zipped({"k.jsonl": jsonl([chat_row("k.png")]), "k.png": GREEN})).json()
    storage, scratch = open_storage(settings), settings.cache_dir / "incoming"
    # an upload killed after storing its manifest and an image, before its row; and its scratch files
    cut = "0123456789abcdef0123456789abcdef"
    (scratch / f".incoming-{cut}.zip").write_bytes(b"PK")
    (scratch / f".unpacked-{cut}" / "files").mkdir(parents=True)
    (scratch / f".unpacked-{cut}" / "files" / "t.jsonl").write_bytes(b"{}")
    storage.put_stream(f"datasets/{cut}/images.txt", io.BytesIO(f"{sha(RED)}\n".encode()))
    storage.put_stream(f"images/{sha(RED)[:2]}/{sha(RED)}", io.BytesIO(RED))
    storage.put_stream(f"images/{sha(BLUE)[:2]}/{sha(BLUE)}", io.BytesIO(BLUE))  # named by none
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]
        assert datasets.sweep_incoming(session, storage=storage, scratch=scratch) == [cut]
    assert images_stored(settings) == [sha(GREEN)]
    assert sorted(p.name for p in (settings.home / "datasets").iterdir()) == [kept["id"]]
    assert scratch_left(settings) == []


def test_a_csv_in_an_archive_keeps_its_columns_and_names_its_images_by_hash(
    client: TestClient, settings: Settings
) -> None:
    import csv

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["conversations", "images"])
    writer.writerow([json.dumps([human("<image>What?"), gpt("red")]), json.dumps(["red.png"])])
    writer.writerow([json.dumps([human("<image>And?"), gpt("blue")]), json.dumps(["blue.png"])])
    r = upload(client, "c.zip", zipped({"c.csv": out.getvalue().encode(), "red.png": RED, "blue.png": BLUE}))
    assert r.status_code == 201, r.text
    stored = settings.home / "datasets" / r.json()["id"] / "c.csv"
    with stored.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [json.loads(row["images"]) for row in rows] == [[f"sha256:{sha(RED)}"], [f"sha256:{sha(BLUE)}"]]
    assert json.loads(rows[0]["conversations"])[0]["value"] == "<image>What?"


def test_on_an_s3_store_images_live_in_the_store_and_are_pulled_where_read(
    settings: Settings, s3_server: S3Server, tmp_path: Path
) -> None:
    client, storage = s3_app(settings, s3_server)
    with client:
        archive = zipped({"s.jsonl": jsonl([chat_row("r.png", "b.png")]), "r.png": RED, "b.png": BLUE})
        r = upload(client, "s.zip", archive)
        assert r.status_code == 201, r.text
        ident = r.json()["id"]
        keys = [key for key, _ in storage.list("images")]
        assert keys == sorted(f"images/{h[:2]}/{h}" for h in (sha(RED), sha(BLUE)))
        assert images_stored(settings) == []  # nothing in the home folder: the store has them
        with client.app.state.sessions() as session:  # type: ignore[attr-defined]
            found = datasets.get_dataset(session, dataset_id=ident)
            assert found is not None
            assert datasets.image_store(storage, found) == "images"  # a key: the worker pulls
            pulled = datasets.local_images(storage, found, cache=tmp_path / "cache")
        assert pulled == tmp_path / "cache" / "images"
        assert (pulled / sha(RED)[:2] / sha(RED)).read_bytes() == RED
        worker = store_images.folder_for(storage, [f"datasets/{ident}/s.jsonl"], cache=tmp_path / "worker")
        assert sorted(p.name for p in worker.rglob("*") if p.is_file()) == sorted([sha(RED), sha(BLUE)])
        assert client.delete(f"/api/datasets/{ident}").status_code == 204
        assert storage.list("images") == [] and storage.list("datasets") == []
