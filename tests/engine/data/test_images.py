"""Rows with images: the OpenAI and ShareGPT/LLaVA layouts, image references (data URLs, files
beside the dataset or in its archive, ``sha256:`` in the image store, http refused), Parquet with
image bytes, and each validation error named by line and field."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from engine.data.archives import member_path
from engine.data.encode import load_rows, validate
from engine.data.read import check_rows, read_records
from engine.data.sequences import Encoded, EncodedPair
from engine.errors import ConfigError
from tests.engine.tiny import tiny_tokenizer
from tests.engine.tiny_vision import png

RED = png(20, 12, seed=1)
BLUE = png(8, 30, seed=2)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def answer(value: str) -> dict[str, str]:
    return {"role": "assistant", "content": value}


def openai_row(*first: Any, second: Any = None) -> dict[str, Any]:
    """A two-turn conversation: ``first`` parts, then ``second`` parts (text when None)."""
    turns = [user(*first), answer("a red square")]
    turns += [user(*(second or [text("and now?")])), answer("a blue bar")]
    return {"messages": turns}


def jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def errors_of(path: Path, **kw: Any) -> list[str]:
    return [str(e) for e in check_rows(path, **kw).errors]


def test_openai_rows_read_data_urls_and_files_beside_the_dataset(tmp_path: Path) -> None:
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "red.png").write_bytes(RED)
    rows = [
        openai_row(
            text("what is it? "), image("pics/red.png"), second=[image(data_url(BLUE)), text("this?")]
        ),
        {"messages": [user(text("no image")), answer("fine")]},
    ]
    found = check_rows(jsonl(tmp_path / "train.jsonl", rows))
    assert found.format == "chat" and not found.errors and found.images == 2
    first, second = found.examples
    assert [r.data for r in first.images] == [RED, BLUE]
    assert [r.field for r in first.images] == [
        "messages[0].content[1].image_url.url",
        "messages[2].content[0].image_url.url",
    ]
    assert first.messages is not None and first.messages[0]["content"] == "what is it? \ufffc"
    assert second.images == () and second.messages == [
        {"role": "user", "content": "no image"},
        {"role": "assistant", "content": "fine"},
    ]
    # a text row may hold the character that marks an image in a row with images
    text_only = check_rows(
        jsonl(tmp_path / "text.jsonl", [{"messages": [user(text("\ufffc")), answer("?")]}])
    )
    assert not text_only.errors and text_only.examples[0].images == ()


def test_sharegpt_rows_pair_placeholders_with_the_images_column(tmp_path: Path) -> None:
    (tmp_path / "red.png").write_bytes(RED)
    row = {
        "conversations": [
            {"from": "human", "value": "<image>what is it?"},
            {"from": "gpt", "value": "a red square"},
            {"from": "human", "value": "and <image>?"},
            {"from": "gpt", "value": "a blue bar"},
        ],
        "images": ["red.png", data_url(BLUE)],
        "system": "be brief",
    }
    llava = {
        "image": "red.png",
        "conversations": [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "red"}],
    }
    trl = {
        "messages": [{"role": "user", "content": [{"type": "image"}, text("what?")]}, answer("blue")],
        "images": [data_url(BLUE)],
    }
    found = check_rows(jsonl(tmp_path / "t.jsonl", [row, llava, trl]))
    assert found.format == "sharegpt" and not found.errors, found.errors
    first, second, third = found.examples
    assert first.messages is not None and [m["role"] for m in first.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert (
        first.messages[1]["content"] == "\ufffcwhat is it?" and first.messages[3]["content"] == "and \ufffc?"
    )
    assert [r.data for r in first.images] == [RED, BLUE] and first.images[0].field == "images[0]"
    assert [r.data for r in second.images] == [RED] and [r.data for r in third.images] == [BLUE]
    assert second.images[0].field == "image"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            openai_row(text("a"), image("missing.png")),
            "line 1: messages[0].content[1].image_url.url: image file 'missing.png' not found",
        ),
        (openai_row(image("junk.png")), "line 1: messages[0].content[0].image_url.url: not a readable image"),
        (
            openai_row(image("http://example.com/x.png")),
            "line 1: messages[0].content[0].image_url.url: 'http://example.com/x.png': http(s) image URLs "
            "are not fetched",
        ),
        (
            openai_row(image("../up.png")),
            "line 1: messages[0].content[0].image_url.url: '../up.png': give a file name relative",
        ),
        (
            openai_row(image("/etc/x.png")),
            "line 1: messages[0].content[0].image_url.url: '/etc/x.png': give a file name relative",
        ),
        (
            openai_row(image("data:image/png;base64,@@@")),
            "line 1: messages[0].content[0].image_url.url: the data URL's base64 is invalid",
        ),
        (
            openai_row(image("sha256:abc")),
            "line 1: messages[0].content[0].image_url.url: 'sha256:abc' is not sha256: and 64",
        ),
        (
            {"messages": [user(text("hi")), {"role": "assistant", "content": [image(data_url(RED))]}]},
            "line 1: messages[1]: an image in an assistant turn",
        ),
        (
            openai_row(text("odd \ufffc"), image("big.png")),
            "line 1: messages[0]: the text holds U+FFFC, the character that marks an image",
        ),
        (
            {"messages": [user({"type": "image_url"}), answer("x")]},
            "line 1: messages[0].content[0].image_url: an image part without its image",
        ),
        (
            {
                "conversations": [
                    {"from": "human", "value": "<image><image>hi"},
                    {"from": "gpt", "value": "x"},
                ],
                "images": ["big.png"],
            },
            "line 1: conversations: 2 image placeholders ('<image>' or image parts) but 1 image in 'images'",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}],
                "images": ["big.png"],
            },
            "line 1: conversations: 0 image placeholders ('<image>' or image parts) but 1 image in 'images'",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>"}],
                "images": ["big.png"],
            },
            "line 1: conversations[1]: an image in an assistant turn",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}],
                "image": "no.png",
            },
            "line 1: conversations: 0 image placeholders ('<image>' or image parts) but 1 image in 'image'",
        ),
        (
            {
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
                "image": "no.png",
            },
            "line 1: image: image file 'no.png' not found",
        ),
        (
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]},
            "line 1: conversations[1]: unknown speaker 'bot'",
        ),
    ],
)
def test_each_image_error_names_its_line_and_field(tmp_path: Path, row: dict[str, Any], message: str) -> None:
    (tmp_path / "junk.png").write_bytes(b"not a picture")
    (tmp_path / "big.png").write_bytes(RED)
    errors = errors_of(jsonl(tmp_path / "t.jsonl", [row]))
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_an_oversized_image_is_refused_by_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.vision.pixels as pixels

    monkeypatch.setattr(pixels.open_image, "__kwdefaults__", {"max_pixels": 20 * 12 - 1})
    rows = [openai_row(image(data_url(png(10, 10)))), openai_row(image(data_url(RED)))]  # 100, 240 pixels
    errors = errors_of(jsonl(tmp_path / "t.jsonl", rows))
    assert errors == [
        "line 2: messages[0].content[0].image_url.url: the image is 20x12 pixels, more than the 239 allowed"
    ]


def store_image(store: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (store / digest[:2]).mkdir(parents=True, exist_ok=True)
    (store / digest[:2] / digest).write_bytes(data)
    return f"sha256:{digest}"


def test_sha256_references_read_from_the_image_store(tmp_path: Path) -> None:
    store = tmp_path / "images"
    ref = store_image(store, RED)
    missing = "sha256:" + "0" * 64
    path = jsonl(tmp_path / "t.jsonl", [openai_row(image(ref)), openai_row(image(missing))])
    found = check_rows(path, image_store=store)
    assert [r.data for r in found.examples[0].images] == [RED]
    assert [str(e) for e in found.errors] == [
        f"line 2: messages[0].content[0].image_url.url: {missing}: not in the image store"
    ]
    unset = errors_of(path)
    assert (
        unset[0] == f"line 1: messages[0].content[0].image_url.url: {ref}: no image store is configured "
        "(data.image_store)"
    )


def write_archive(path: Path, members: dict[str, bytes]) -> Path:
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return path
    with tarfile.open(path, "w:gz" if path.name.endswith(".gz") else "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


ARCHIVED = json.dumps(openai_row(image("images/red.png"), second=[image("images/blue.png")])) + "\n"


@pytest.mark.parametrize("name", ["data.zip", "data.tar", "data.tar.gz"])
def test_an_archive_holds_the_data_file_and_its_images(tmp_path: Path, name: str) -> None:
    members = {"set/train.jsonl": ARCHIVED.encode(), "images/red.png": RED, "images/blue.png": BLUE}
    path = write_archive(tmp_path / name, {**members, "__MACOSX/._x": b"", "images/.DS_Store": b""})
    found = check_rows(path)
    assert found.format == "chat" and found.rows == 1 and not found.errors, found.errors
    assert [r.data for r in found.examples[0].images] == [RED, BLUE]
    assert [rec for _, rec in read_records(path)] == [json.loads(ARCHIVED)]
    assert validate(str(path)).ok


def test_an_archive_must_hold_one_data_file_and_no_escaping_member(tmp_path: Path) -> None:
    none = write_archive(tmp_path / "none.zip", {"images/red.png": RED})
    with pytest.raises(
        ValueError, match=r"none.zip: the archive holds no data file \(.jsonl, .csv, .parquet\)"
    ):
        check_rows(none)
    two = write_archive(tmp_path / "two.tar", {"a.jsonl": ARCHIVED.encode(), "b.csv": b"text\nx\n"})
    with pytest.raises(
        ValueError, match=r"two.tar: the archive holds 2 data files \(a.jsonl, b.csv\); give one"
    ):
        check_rows(two)
    escaping = write_archive(tmp_path / "up.tar", {"../evil.jsonl": ARCHIVED.encode()})
    with pytest.raises(ValueError, match=r"archive member '../evil.jsonl': '..' in its name"):
        check_rows(escaping)
    with pytest.raises(ValueError, match="an absolute name"):
        member_path("/etc/passwd")
    (tmp_path / "bad.zip").write_bytes(b"PK not really")
    with pytest.raises(ValueError, match=r"bad\.zip: not a readable zip archive"):
        check_rows(tmp_path / "bad.zip")


def test_archive_names_start_from_the_data_files_folder_then_the_root(tmp_path: Path) -> None:
    beside = json.dumps(openai_row(image("pics/red.png"), second=[image("images/blue.png")])) + "\n"
    members = {"set/train.jsonl": beside.encode(), "set/pics/red.png": RED, "images/blue.png": BLUE}
    found = check_rows(write_archive(tmp_path / "d.zip", members))
    assert not found.errors and [r.data for r in found.examples[0].images] == [RED, BLUE]
    outside = json.dumps(openai_row(image("set/../../x.png"))) + "\n"
    assert errors_of(write_archive(tmp_path / "e.zip", {"set/train.jsonl": outside.encode()}))[0].endswith(
        "give a file name relative to the dataset's folder (no absolute path, no '..')"
    )


def test_a_missing_image_of_an_archive_names_its_line(tmp_path: Path) -> None:
    path = write_archive(tmp_path / "d.zip", {"train.jsonl": ARCHIVED.encode(), "images/red.png": RED})
    assert errors_of(path) == [
        "line 1: messages[2].content[0].image_url.url: image file 'images/blue.png' not found beside the "
        "dataset"
    ]


def test_parquet_image_bytes_as_binary_and_as_structs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "blue.png").write_bytes(BLUE)
    convo = json.dumps([{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "red"}])
    structs = pa.table(
        {
            "conversations": [json.loads(convo), json.loads(convo)],
            "images": [[{"bytes": RED, "path": "red.png"}], [{"bytes": None, "path": "blue.png"}]],
        }
    )
    pq.write_table(structs, tmp_path / "structs.parquet")
    found = check_rows(tmp_path / "structs.parquet")
    assert found.format == "sharegpt" and found.unit == "row" and not found.errors, found.errors
    assert [[r.data for r in e.images] for e in found.examples] == [[RED], [BLUE]]
    assert found.examples[1].images[0].field == "images[0].path"
    binary = pa.table({"conversations": [json.loads(convo)], "image": pa.array([RED], pa.binary())})
    pq.write_table(binary, tmp_path / "binary.parquet")
    found = check_rows(tmp_path / "binary.parquet")
    assert [[r.data for r in e.images] for e in found.examples] == [[RED]]
    broken = pa.table({"conversations": [json.loads(convo)], "images": [[b"\x89PNG broken"]]})
    pq.write_table(broken, tmp_path / "broken.parquet")
    assert errors_of(tmp_path / "broken.parquet") == [
        "row 1: images[0]: not a readable image (UnidentifiedImageError)"
    ]


def test_images_are_refused_by_the_other_formats_and_methods(tmp_path: Path) -> None:
    pair = {"prompt": [user(image(data_url(RED)), text("which?"))], "chosen": "red", "rejected": "blue"}
    errors = errors_of(jsonl(tmp_path / "p.jsonl", [pair]))
    assert errors == [
        "line 1: prompt[0].content[0].image_url.url: an image, and these rows take text only: images train "
        "with supervised fine-tuning (method.objective 'sft') on chat or ShareGPT rows"
    ]
    path = jsonl(tmp_path / "c.jsonl", [openai_row(image(data_url(RED)))])
    with pytest.raises(ConfigError, match=r"holds 1 images; method.objective 'grpo' trains on text"):
        load_rows(str(path), tiny_tokenizer(), Encoded, method="grpo")
    with pytest.raises(ConfigError, match=r"holds 1 images; method.objective 'dpo' trains on text"):
        load_rows(str(path), tiny_tokenizer(), EncodedPair)


def test_a_text_model_refuses_a_row_with_images(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "c.jsonl", [openai_row(image(data_url(RED)))])
    report = validate(str(path), tokenizer=tiny_tokenizer())
    assert [str(e) for e in report.errors] == [
        "line 1: messages[0].content[0].image_url.url: an image, but the model is a text model (images "
        "train a vision-language model)"
    ]
    assert validate(str(path)).ok and validate(str(path)).images == 1


def test_an_archive_link_is_refused(tmp_path: Path) -> None:
    import stat

    with zipfile.ZipFile(tmp_path / "link.zip", "w") as zf:
        zf.writestr("train.jsonl", ARCHIVED)
        info = zipfile.ZipInfo("images/red.png")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    with pytest.raises(ValueError, match=r"archive member 'images/red\.png': not a plain file"):
        check_rows(tmp_path / "link.zip")
    with tarfile.open(tmp_path / "link.tar", "w") as tf:
        data = ARCHIVED.encode()
        member = tarfile.TarInfo("train.jsonl")
        member.size = len(data)
        tf.addfile(member, io.BytesIO(data))
        link = tarfile.TarInfo("images/red.png")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
    with pytest.raises(ValueError, match=r"archive member 'images/red\.png': not a plain file"):
        check_rows(tmp_path / "link.tar")


def test_a_link_out_of_the_dataset_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outside.png").write_bytes(RED)
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "red.png").symlink_to(tmp_path / "outside.png")
    errors = errors_of(jsonl(tmp_path / "set" / "t.jsonl", [openai_row(image("red.png"))]))
    assert errors == [
        "line 1: messages[0].content[0].image_url.url: image file 'red.png' lies outside the dataset's folder"
    ]


def test_unpack_counts_the_bytes_it_writes(tmp_path: Path) -> None:
    from engine.data.archives import unpack

    path = write_archive(tmp_path / "d.tar.gz", {"train.jsonl": ARCHIVED.encode(), "images/red.png": RED})
    found = unpack(path, tmp_path / "out", max_bytes=len(ARCHIVED) + len(RED))
    assert (
        found.data == tmp_path / "out" / "train.jsonl"
        and (found.root / "images" / "red.png").read_bytes() == RED
    )
    with pytest.raises(ValueError, match="the folder to unpack into is not empty"):
        unpack(path, tmp_path / "out")
    with pytest.raises(
        ValueError, match=f"the archive unpacks to more than {len(ARCHIVED) + len(RED) - 1} bytes"
    ):
        unpack(path, tmp_path / "small", max_bytes=len(ARCHIVED) + len(RED) - 1)
