"""The image store (``server.storage.images``) and how an upload's image references are resolved
and rewritten (``server.services.dataset_images``), without the service around them."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from server.services import dataset_images
from server.services.dataset_images import Resolver, Staged, rewrite, rewrite_file
from server.storage import LocalStorage
from server.storage import images as store_images
from tests.engine.tiny_vision import png

RED, BLUE = png(8, 6, seed=1), png(5, 9, seed=2)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def stored(store: LocalStorage) -> list[str]:
    return sorted(key.rsplit("/", 1)[-1] for key, _ in store.list(store_images.FOLDER))


def resolver(tmp_path: Path, *, roots: list[Path] | None = None, fetch: bool = False) -> Resolver:
    store = LocalStorage(tmp_path / "home")
    return Resolver(Staged(tmp_path / "staged"), storage=store, roots=roots or [], fetch_urls=fetch)


def test_publish_stores_each_image_once_and_removes_it_with_its_last_dataset(tmp_path: Path) -> None:
    store, staged = LocalStorage(tmp_path / "home"), Staged(tmp_path / "staged")
    red = staged.add(RED)
    staged.add(BLUE)
    assert red == f"sha256:{sha(RED)}" and staged.add(RED) == red and len(staged.digests) == 2
    lock = tmp_path / "lock"
    store_images.publish(
        store, dataset_folder="datasets/a", staged=staged.folder, digests=staged.digests, lock_dir=lock
    )
    store_images.publish(
        store, dataset_folder="datasets/b", staged=staged.folder, digests=[sha(RED)], lock_dir=lock
    )
    assert stored(store) == sorted([sha(RED), sha(BLUE)])
    assert (tmp_path / "home" / "images" / sha(RED)[:2] / sha(RED)).read_bytes() == RED
    assert store_images.read_manifest(store, "datasets/a") == {sha(RED), sha(BLUE)}

    store.delete_prefix("datasets/a")
    gone = store_images.remove_unused(store, [sha(RED), sha(BLUE)], datasets_folder="datasets", lock_dir=lock)
    assert gone == [sha(BLUE)] and stored(store) == [sha(RED)]  # b still names red
    store.delete_prefix("datasets/b")
    assert store_images.remove_unused(store, [sha(RED)], datasets_folder="datasets", lock_dir=lock) == [
        sha(RED)
    ]
    assert stored(store) == []


def test_sweep_removes_the_images_no_manifest_lists(tmp_path: Path) -> None:
    store, staged = LocalStorage(tmp_path / "home"), Staged(tmp_path / "staged")
    staged.add(RED), staged.add(BLUE)
    store_images.publish(
        store, dataset_folder="datasets/a", staged=staged.folder, digests=[sha(RED)], lock_dir=None
    )
    store.put_file(
        store_images.image_key(sha(BLUE)), store_images.staged_path(staged.folder, sha(BLUE))
    )  # left by a crash
    assert store_images.sweep(store, datasets_folder="datasets", lock_dir=None) == [sha(BLUE)]
    assert stored(store) == [sha(RED)]


def test_local_folder_pulls_the_named_images_from_a_remote_store(tmp_path: Path) -> None:
    class Remote(LocalStorage):
        def local_path(self, key: str) -> Path | None:
            return None

    store, staged = Remote(tmp_path / "home"), Staged(tmp_path / "staged")
    staged.add(RED)
    store_images.publish(
        store, dataset_folder="datasets/a", staged=staged.folder, digests=[sha(RED)], lock_dir=None
    )
    folder = store_images.local_folder(store, [sha(RED)], cache=tmp_path / "cache")
    assert folder == tmp_path / "cache" / "images"
    assert store_images.staged_path(folder, sha(RED)).read_bytes() == RED
    with pytest.raises(FileNotFoundError):
        store_images.local_folder(store, [sha(BLUE)], cache=tmp_path / "cache")


def test_every_place_a_row_names_an_image_is_rewritten(tmp_path: Path) -> None:
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(RED)
    resolve = resolver(tmp_path, roots=[tmp_path])
    openai: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "what?"},
                {"type": "image_url", "image_url": {"url": "pics/red.png"}},
                {"type": "image_url", "image_url": data_url(BLUE)},
                {"type": "image", "image": "pics/red.png"},
            ]},
            {"role": "assistant", "content": "colours"},
        ]
    }  # fmt: skip
    assert rewrite(openai, resolve)
    parts = openai["messages"][0]["content"]
    assert parts[1]["image_url"] == {"url": f"sha256:{sha(RED)}"}
    assert parts[2]["image_url"] == f"sha256:{sha(BLUE)}" and parts[3]["image"] == f"sha256:{sha(RED)}"
    llava: dict[str, Any] = {
        "conversations": [{"from": "human", "value": "<image><image>"}],
        "images": [{"bytes": BLUE, "path": None}, {"bytes": None, "path": "pics/red.png"}],
    }
    assert rewrite(llava, resolve) and llava["images"] == [f"sha256:{sha(BLUE)}", f"sha256:{sha(RED)}"]
    single = {"conversations": [], "image": RED}
    assert rewrite(single, resolve) and single["image"] == f"sha256:{sha(RED)}"
    assert not rewrite({"messages": [{"role": "user", "content": "text only"}]}, resolve)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("https://example.com/cat.png", "ROUNDHOUSE_ALLOW_IMAGE_URLS=1"),
        ("HTTP://EXAMPLE.COM/CAT.PNG", "ROUNDHOUSE_ALLOW_IMAGE_URLS=1"),
        ("../secret.png", "must stay inside the archive"),
        ("/etc/passwd", "must stay inside the archive"),
        ("pics/missing.png", "no such file in the archive"),
        ("data:image/png;base64,@@@", "base64 is invalid"),
        ("data:text/plain;base64,aGk=", "not an image"),
        ("ftp://host/a.png", "unsupported URL scheme"),
        ("sha256:" + "0" * 64, "no such image in the store"),
        (5, "got int"),
        ("", "got ''"),
    ],
)
def test_a_bad_reference_is_refused_naming_its_field(tmp_path: Path, value: Any, says: str) -> None:
    (tmp_path / "pics").mkdir()
    row = {"images": ["pics/ok.png", value]}
    (tmp_path / "pics" / "ok.png").write_bytes(RED)
    with pytest.raises(ValueError, match="images\\[1\\]: ") as caught:
        rewrite(row, resolver(tmp_path, roots=[tmp_path]))
    assert says in str(caught.value)
    assert str(tmp_path) not in str(caught.value)


def test_a_file_name_in_a_lone_data_file_and_an_oversized_image_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="upload a zip/tar"):
        rewrite({"images": ["a.png"]}, resolver(tmp_path))
    big = b"\x89PNG" + bytes(dataset_images.max_image_bytes())
    with pytest.raises(ValueError, match=f"limit of {dataset_images.max_image_bytes()}"):
        rewrite({"images": [big]}, resolver(tmp_path))


def test_rewrite_file_keeps_the_format_and_copies_the_rows_before_the_first_image(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(RED)}}]},
            {"role": "assistant", "content": "red"},
        ]},
    ]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = rewrite_file(
        source, target=tmp_path / "out" / "in.jsonl", resolve=resolver(tmp_path), max_errors=10
    )
    assert done.has_images and done.path is not None and not done.errors
    out = [json.loads(line) for line in done.path.read_text().splitlines()]
    assert (
        out[0] == rows[0] and out[1]["messages"][0]["content"][0]["image_url"]["url"] == f"sha256:{sha(RED)}"
    )

    images = [None] * 1100 + [[{"bytes": RED, "path": "x"}], [{"bytes": BLUE, "path": None}]]
    n = len(images)
    table = pa.table(
        {"id": pa.array(range(n), pa.int32()), "conversations": ["<image>"] * n, "images": images}
    )
    pq.write_table(table, tmp_path / "in.parquet")
    done = rewrite_file(
        tmp_path / "in.parquet",
        target=tmp_path / "out" / "in.parquet",
        resolve=resolver(tmp_path),
        max_errors=10,
    )
    assert done.path is not None
    back = pq.read_table(done.path)  # the first 1100 rows hold no image: the types come from the source
    assert back.schema.field("id").type == pa.int32() and back.num_rows == n
    assert back.column("images").to_pylist()[-3:] == [None, [f"sha256:{sha(RED)}"], [f"sha256:{sha(BLUE)}"]]

    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "no images"}\n')
    done = rewrite_file(
        text, target=tmp_path / "out" / "text.jsonl", resolve=resolver(tmp_path), max_errors=10
    )
    assert not done.has_images and done.path is None and not (tmp_path / "out" / "text.jsonl").exists()


def test_rewrite_file_reports_each_bad_line_and_writes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"images": [f"missing{i}.png"]}) + "\n" for i in range(5)))
    done = rewrite_file(
        source, target=tmp_path / "o.jsonl", resolve=resolver(tmp_path, roots=[tmp_path]), max_errors=3
    )
    assert done.errors_total == 5 and [e.line for e in done.errors] == [1, 2, 3] and done.path is None
    assert "images[0]: 'missing0.png': no such file" in done.errors[0].message
    assert not (tmp_path / "o.jsonl").exists()


def test_the_images_of_one_upload_may_come_to_a_limit(tmp_path: Path) -> None:
    staged = Staged(tmp_path / "staged", max_bytes=len(RED) + len(BLUE))
    staged.add(RED), staged.add(BLUE), staged.add(RED)  # the same bytes twice: counted once
    assert staged.total == len(RED) + len(BLUE)
    with pytest.raises(ValueError, match=f"come to more than {len(RED) + len(BLUE)} bytes"):
        staged.add(png(4, 4, seed=9))


def test_the_datasets_service_loads_no_torch_until_an_image_is_read() -> None:
    import subprocess
    import sys

    code = "import sys, server.api.datasets, server.services.datasets; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
