"""Dataset pulls from a local server that speaks the Hub's API: a split's own JSONL files joined,
validated and stored like an upload with its source; the Hub's Parquet conversion when the repo
has no file for the split; a broken split refused with its bad lines; an unknown split a 404."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.server.test_hub_models import api, settings_for
from tests.utils.fake_hub import FakeHub
from tests.utils.filesystems import fill, small_disk

ROWS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i in range(6)
]


def jsonl(rows: list[dict[str, object]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    fake = FakeHub().start()
    broken = [*ROWS[:2], {"messages": [{"role": "user", "content": "no answer"}]}, *ROWS[2:]]
    fake.add(
        "org/chat",
        {
            "README.md": b"# data",
            "data/train-00000-of-00002.jsonl": jsonl(ROWS[:3]),
            "data/train-00001-of-00002.jsonl": jsonl(ROWS[3:]),
            "data/test-00000-of-00001.jsonl": jsonl(broken),
        },
        kind="dataset",
    )
    table = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist([{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]), table
    )
    repo = fake.add("org/converted", {"README.md": b"# only a card"}, kind="dataset")
    repo.revisions["refs/convert/parquet"] = {"default/train/0000.parquet": table.getvalue()}
    yield fake
    fake.stop()


def test_a_split_is_pulled_validated_and_stored_with_its_source(tmp_path: Path, hub: FakeHub) -> None:
    with api(settings_for(tmp_path, hub)) as client:
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "train"})
        assert r.status_code == 201, r.text
        stored = r.json()
        assert stored["rows"] == 6 and stored["format"] == "chat" and stored["filename"].endswith(".jsonl")
        source = stored["source"]
        assert source["hub"] == "org/chat" and source["split"] == "train" and source["from"] == "repo"
        assert source["files"] == ["data/train-00000-of-00002.jsonl", "data/train-00001-of-00002.jsonl"]
        preview = client.get(f"/api/datasets/{stored['id']}/preview", params={"model": "tiny"})
        assert preview.status_code in (200, 404), preview.text  # the same preview route as an upload

        r = client.post("/api/datasets/pulls", json={"repo_id": "org/converted", "split": "train"})
        assert r.status_code == 201, r.text
        assert r.json()["rows"] == 5 and r.json()["source"]["from"] == "parquet-conversion"

        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "test"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_dataset" and error["errors_total"] == 1
        assert error["details"][0]["line"] == 3, error

        r = client.post("/api/datasets/pulls", json={"repo_id": "org/chat", "split": "validation"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "split", r.text
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/none", "split": "train"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "repo_id", r.text
        assert len(client.get("/api/datasets").json()["data"]) == 2


def test_a_dataset_pull_that_fills_the_disk_answers_507_and_leaves_nothing(
    tmp_path: Path, hub: FakeHub
) -> None:
    """The split's files arrive in the cache folder's scratch, here a small real disk with 64 KiB
    free: the pull answers 507 naming it, the bytes it needs and free, its partial files are gone
    and no dataset is made; so too when the download fits but its copy as an upload does not;
    once space is freed the same pull succeeds."""
    long: list[dict[str, object]] = [
        {"messages": [{"role": "user", "content": "q" * 1000}, {"role": "assistant", "content": "a"}]}
    ]
    hub.add("org/long", {"data/train-00000-of-00001.jsonl": jsonl(long * 1000)}, kind="dataset")
    settings = settings_for(tmp_path, hub)
    with small_disk(settings.cache_dir, 4 << 20) as disk, api(settings) as client:
        ballast = fill(disk, leave_bytes=64 * 1024)
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/long", "split": "train"})
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "disk_full" and f"writing {disk / 'hub-scratch'}" in error["message"], error
        needed = int(error["message"].split(" needs ", 1)[1].split(" bytes", 1)[0])
        free = int(error["message"].split(" bytes, ", 1)[1].split(" bytes", 1)[0])
        assert needed == len(jsonl(long * 1000)) and free < needed, error
        assert list((disk / "hub-scratch").iterdir()) == []
        assert client.get("/api/datasets").json()["data"] == []
        # room for the download, not for its copy as an upload (in the same scratch disk)
        ballast.unlink()
        ballast = fill(disk, leave_bytes=len(jsonl(long * 1000)) + 256 * 1024)
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/long", "split": "train"})
        assert r.status_code == 507, r.text
        assert f"writing {disk / 'incoming' / '.incoming-'}" in r.json()["error"]["message"], r.text
        assert list((disk / "hub-scratch").iterdir()) == [] and not list(disk.rglob(".incoming-*"))
        assert client.get("/api/datasets").json()["data"] == []
        ballast.unlink()
        r = client.post("/api/datasets/pulls", json={"repo_id": "org/long", "split": "train"})
        assert r.status_code == 201, r.text
        assert [d["rows"] for d in client.get("/api/datasets").json()["data"]] == [1000]
