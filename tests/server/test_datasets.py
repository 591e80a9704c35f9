"""Dataset uploads under hostile input: the size limit holds while the body arrives, the error
report is bounded, odd file names are kept or refused cleanly, and no answer shows a server path.
Each refusal is a 4xx in the one error shape and leaves nothing behind."""

from __future__ import annotations

import json
from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient

from server.services import datasets
from server.settings import Settings
from server.storage import open_storage

LIMIT_OVERHEAD = 65536  # what the server allows past max_upload_bytes for the multipart framing
BOUNDARY = "roundhouse-test-boundary"


def left_behind(settings: Settings) -> list[str]:
    """Everything under the datasets folder (files and folders)."""
    folder = settings.datasets_dir
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def multipart(filename: bytes, content: Iterator[bytes], *, name: bytes | None = None) -> Iterator[bytes]:
    """A multipart/form-data body, produced lazily (``content`` may be endless)."""
    b = BOUNDARY.encode()
    if name is not None:
        yield b"--" + b + b'\r\nContent-Disposition: form-data; name="name"\r\n\r\n' + name + b"\r\n"
    yield b"--" + b + b'\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n\r\n'
    yield from content
    yield b"\r\n--" + b + b"--\r\n"


def post_asgi(
    client: TestClient, chunks: Iterator[bytes], *, content_length: int | None = None
) -> tuple[int, dict[str, Any], int]:
    """POST /api/datasets straight into the app, the body in ``chunks`` (chunked unless
    ``content_length``). Returns the status, the JSON answer and how many body bytes the app read."""
    headers = [
        (b"host", b"testserver"),
        (b"authorization", client.headers["Authorization"].encode()),
        (b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode()),
    ]
    headers.append(
        (b"content-length", str(content_length).encode())
        if content_length is not None
        else (b"transfer-encoding", b"chunked")
    )
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/datasets",
        "raw_path": b"/api/datasets",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "extensions": {},
        "state": {},
    }
    read = 0
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        nonlocal read
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        read += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def call() -> None:
        await client.app(scope, receive, send)  # type: ignore[arg-type, call-arg]

    anyio.run(call)
    answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return sent[0]["status"], answer, read


def endless_jsonl(total: int) -> Iterator[bytes]:
    line = b'{"text": "' + b"x" * 1000 + b'"}\n'
    block = line * 64
    for _ in range(total // len(block)):
        yield block


def test_a_chunked_upload_is_refused_as_it_passes_the_limit(client: TestClient, settings: Settings) -> None:
    limit = settings.max_upload_bytes
    status, answer, read = post_asgi(client, multipart(b"big.jsonl", endless_jsonl(40 << 20)))
    assert status == 413 and answer["error"]["code"] == "too_large", answer
    assert answer["error"]["param"] == "file" and str(limit) in answer["error"]["message"]
    # the app stopped reading about where the limit lies, not 40 MB later
    assert read <= limit + LIMIT_OVERHEAD + (64 << 10), read
    assert left_behind(settings) == []


def test_an_upload_whose_content_length_is_over_the_limit_is_refused_unread(
    client: TestClient, settings: Settings
) -> None:
    announced = settings.max_upload_bytes + LIMIT_OVERHEAD + 1
    status, answer, read = post_asgi(
        client, multipart(b"big.jsonl", endless_jsonl(4 << 20)), content_length=announced
    )
    assert status == 413 and answer["error"]["code"] == "too_large", answer
    assert read == 0
    assert left_behind(settings) == []


def test_an_upload_without_a_valid_key_is_refused_unread(client: TestClient, settings: Settings) -> None:
    client.headers["Authorization"] = "Bearer rh_not_a_key"
    status, answer, read = post_asgi(client, multipart(b"big.jsonl", endless_jsonl(4 << 20)))
    assert status == 401 and answer["error"]["code"] == "unauthorized", answer
    assert read == 0
    assert left_behind(settings) == []


def test_the_error_report_is_capped(client: TestClient, settings: Settings) -> None:
    bad = b'{"text": 5}\n' * 5000  # 60 kB, under the limit: 5000 invalid lines
    r = client.post("/api/datasets", files={"file": ("bad.jsonl", bad)})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["code"] == "invalid_dataset" and error["param"] == "file"
    assert [d["line"] for d in error["details"]] == list(range(1, 101))
    assert error["errors_total"] == 5000 and error["errors_truncated"] is True
    assert error["message"].startswith("5000 invalid row(s)") and "(and 4997 more)" in error["message"]
    assert len(r.content) < 20_000
    assert left_behind(settings) == []
    few = client.post("/api/datasets", files={"file": ("bad.jsonl", b'{"text": 5}\n' * 2)}).json()["error"]
    assert few["errors_total"] == 2 and few["errors_truncated"] is False and len(few["details"]) == 2


@pytest.mark.parametrize("field", ["file", "name"])
def test_a_nul_byte_in_the_file_name_or_name_is_refused_and_nothing_is_left(
    client: TestClient, settings: Settings, field: str
) -> None:
    """On PostgreSQL a NUL in a text column fails the INSERT: it was a 500 and an orphan folder."""
    content = iter([b'{"text": "fine"}\n'])
    if field == "file":
        body = multipart(b"train\x00.jsonl", content)
    else:
        body = multipart(b"train.jsonl", content, name=b"my\x00set")
    status, answer, _ = post_asgi(client, body)
    assert status == 422, answer
    assert answer["error"]["param"] == field and "NUL" in answer["error"]["message"]
    assert left_behind(settings) == []
    assert client.get("/api/datasets").json()["data"] == []


def test_a_dataset_name_is_one_line(client: TestClient, settings: Settings) -> None:
    body = multipart(b"train.jsonl", iter([b'{"text": "fine"}\n']), name=b"two\nlines")
    status, answer, _ = post_asgi(client, body)
    assert status == 422 and answer["error"]["param"] == "name", answer
    assert left_behind(settings) == []


def test_a_failed_insert_leaves_no_folder(client: TestClient, settings: Settings) -> None:
    with client.app.state.sessions() as session:  # type: ignore[attr-defined]

        def refuse() -> None:
            raise RuntimeError("the database refused the row")

        session.commit = refuse  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            datasets.store_upload(
                session,
                source=iter_file(b'{"text": "fine"}\n'),
                filename="train.jsonl",
                name=None,
                storage=open_storage(settings),
                scratch=settings.cache_dir / "incoming",
                max_bytes=settings.max_upload_bytes,
            )
    assert left_behind(settings) == []


def iter_file(content: bytes) -> Any:
    import io

    return io.BytesIO(content)


def test_a_long_file_name_keeps_its_suffix(client: TestClient, settings: Settings) -> None:
    long = "a" * 200 + ".jsonl"
    r = client.post("/api/datasets", files={"file": (long, b'{"text": "fine"}\n')})
    assert r.status_code == 201, r.text
    filename = r.json()["filename"]
    assert filename.endswith(".jsonl") and len(filename) <= 120
    assert datasets.safe_name("b" * 300 + ".parquet") == "b" * 112 + ".parquet"
    assert datasets.safe_name("c" * 200 + "." + "d" * 200) == "c" * 120  # no real suffix: just cut


@pytest.mark.parametrize(
    ("filename", "content"),
    [
        ("broken.parquet", b"PAR1 not really a parquet file PAR1"),
        ("broken.csv", b'text\n"a","b"\n'),
        ("broken.jsonl", b"{not json\n"),
    ],
)
def test_no_error_shows_a_server_path(
    client: TestClient, settings: Settings, filename: str, content: bytes
) -> None:
    r = client.post("/api/datasets", files={"file": (filename, content)})
    assert r.status_code == 422, r.text
    for leak in (str(settings.home.resolve()), str(settings.datasets_dir), ".incoming"):
        assert leak not in r.text, (leak, r.text)
    assert left_behind(settings) == []


def pref(question: str, good: str, bad: str) -> dict[str, Any]:
    return {
        "input": {"messages": [{"role": "user", "content": question}]},
        "preferred_output": [{"role": "assistant", "content": good}],
        "non_preferred_output": [{"role": "assistant", "content": bad}],
    }


TWO = "a pair needs two different ones"
PAIRS = [pref(f"How many {n}?", str(n), f"There are {n} of them.") for n in range(6)]


def test_a_preference_file_is_stored_and_previewed_with_both_answers(
    client: TestClient, settings: Settings
) -> None:
    content = "".join(json.dumps(r) + "\n" for r in PAIRS).encode()
    r = client.post("/api/datasets", files={"file": ("pairs.jsonl", content)})
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["format"], ds["rows"]) == ("preference", 6)
    preview = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny", "limit": 3}).json()
    assert [row["line"] for row in preview["rows"]] == [1, 2, 3]
    for n, row in enumerate(preview["rows"]):
        prompt = "".join(t["text"] for t in row["tokens"])
        assert f"How many {n}?" in prompt and not any(t["trained"] for t in row["tokens"])
        answers = {}
        for side in ("chosen", "rejected"):
            tokens = row[side]["tokens"]
            assert row[side]["truncated"] is False
            answers[side] = "".join(t["text"] for t in tokens if t["trained"])
            # the prompt and each answer's tokens make up its whole sequence
            assert "How many" not in "".join(t["text"] for t in tokens)
        assert answers == {"chosen": f"{n}<|im_end|>\n", "rejected": f"There are {n} of them.<|im_end|>\n"}
    stats = client.get(f"/api/datasets/{ds['id']}/stats", params={"model": "tiny"}).json()
    assert stats["sampled"] == 6 and sum(b["count"] for b in stats["histogram"]) == 12  # both answers


def test_a_chat_preview_has_no_answers(client: TestClient) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    ds = client.post("/api/datasets", files={"file": ("chat.jsonl", json.dumps(chat).encode())}).json()
    (row,) = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny"}).json()["rows"]
    assert row["chosen"] is None and row["rejected"] is None
    assert "".join(t["text"] for t in row["tokens"] if t["trained"]) == "hello<|im_end|>\n"


def test_bad_preference_rows_are_refused_by_line_and_nothing_is_kept(
    client: TestClient, settings: Settings
) -> None:
    rows = [
        json.dumps(PAIRS[0]),
        json.dumps(pref("q", "same", "same")),
        json.dumps({"prompt": "q", "chosen": "a"}),
        json.dumps(PAIRS[1]),
        json.dumps({**PAIRS[2], "input": {"messages": [{"role": "assistant", "content": "x"}]}}),
    ]
    r = client.post("/api/datasets", files={"file": ("pairs.jsonl", "\n".join(rows).encode())})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_dataset" and error["errors_total"] == 3
    assert [(d["line"], d["message"]) for d in error["details"]] == [
        (2, "'preferred_output' and 'non_preferred_output' are the same answer; " + TWO),
        (3, "missing field 'rejected'"),
        (5, "input.messages[0]: expected role 'user', got 'assistant' (turns must alternate)"),
    ]
    assert left_behind(settings) == []


def test_a_csv_preference_file_is_stored(client: TestClient) -> None:
    content = b'prompt,chosen,rejected\n"How many, really?",3,"Three, I think."\nsay hi,hi,go away\n'
    r = client.post("/api/datasets", files={"file": ("pairs.csv", content)})
    assert r.status_code == 201, r.text
    assert (r.json()["format"], r.json()["rows"]) == ("preference", 2)
    bad = client.post("/api/datasets", files={"file": ("bad.csv", b"prompt,chosen,rejected\nq,,b\n")})
    assert bad.status_code == 422 and bad.json()["error"]["details"][0]["line"] == 2


@pytest.mark.parametrize(
    ("attr", "expected"),
    [
        ("PREFERENCE_TRAIN", "preference"),
        ("PREFERENCE_HELDOUT", "preference"),
        ("PROMPTS_TRAIN", "prompts"),
        ("PROMPTS_HELDOUT", "prompts"),
    ],
)
def test_the_demo_preference_and_prompts_files_are_stored_as_such(
    client: TestClient, attr: str, expected: str
) -> None:
    from engine import demo
    from server.cli import DEMO_DATASETS

    assert attr in {a for _, a in DEMO_DATASETS}  # `roundhouse serve --demo` stores it
    path = getattr(demo, attr)
    with path.open("rb") as f:
        r = client.post("/api/datasets", files={"file": (path.name, f)})
    assert r.status_code == 201 and r.json()["format"] == expected, r.text


PROMPTS = [
    {"messages": [{"role": "user", "content": f"How many {n}?"}], "reference_answer": str(n)}
    for n in range(3)
] + [{"prompt": "Say hi.", "reference_answer": "hi", "tags": ["short"]}]


def test_a_prompts_file_is_stored_and_previewed_with_its_grader_fields(client: TestClient) -> None:
    content = "".join(json.dumps(r) + "\n" for r in PROMPTS).encode()
    r = client.post("/api/datasets", files={"file": ("prompts.jsonl", content)})
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["format"], ds["rows"]) == ("prompts", 4)
    rows = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny"}).json()["rows"]
    assert [row["line"] for row in rows] == [1, 2, 3, 4]
    for n, row in enumerate(rows[:3]):
        text = "".join(t["text"] for t in row["tokens"])
        # the prompt with the generation prompt a completion follows; nothing trained, no answers
        assert f"How many {n}?" in text and text.endswith("<|im_start|>assistant\n"), text
        assert not any(t["trained"] for t in row["tokens"]) and row["chosen"] is None
        assert row["item"] == {"reference_answer": str(n)}
    assert "".join(t["text"] for t in rows[3]["tokens"]).endswith("Say hi.")
    assert rows[3]["item"] == {"reference_answer": "hi", "tags": ["short"]}
    cut = client.get(f"/api/datasets/{ds['id']}/preview", params={"model": "tiny", "max_length": 8}).json()
    assert cut["rows"][0]["truncated"] and len(cut["rows"][0]["tokens"]) == 8  # its last tokens kept
    stats = client.get(f"/api/datasets/{ds['id']}/stats", params={"model": "tiny", "max_length": 8}).json()
    assert stats["sampled"] == 4 and sum(b["count"] for b in stats["histogram"]) == 4
    assert stats["max"] > 8 and stats["truncated_share"] == 0.75  # the chat prompts, not "Say hi."
    # a row with an answer is no prompt row: a file mixing them is refused by line
    mixed = content + json.dumps({"prompt": "q", "completion": "a"}).encode() + b"\n"
    r = client.post("/api/datasets", files={"file": ("mixed.jsonl", mixed)})
    assert r.status_code == 422 and r.json()["error"]["details"][0]["line"] == 5, r.text
