"""Loss masks token by token, the fallback template, validation reports, packing, batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.data.batches import Batcher, collate, pack
from engine.data.encode import (
    FALLBACK_CHAT_TEMPLATE,
    Encoded,
    encode,
    ensure_chat_template,
    load_encoded,
    validate,
)
from engine.data.read import Example, to_example
from tests.engine.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def trained_text(tok, enc: Encoded) -> str:
    return tok.decode([t for t in enc.labels if t != -100])


def spans(enc: Encoded) -> list[bool]:
    return [t != -100 for t in enc.labels]


def test_chat_mask_covers_exactly_the_assistant_turns(tok) -> None:
    ex = to_example(
        1,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is one plus one?"},
                {"role": "assistant", "content": "two."},
                {"role": "user", "content": "and two plus three?"},
                {"role": "assistant", "content": "five."},
            ]
        },
        "chat",
    )
    enc = encode(ex, tok, 512)
    text = tok.apply_chat_template(ex.messages, tokenize=False)
    assert tok.decode(enc.input_ids) == text
    # token by token: every trained token lies inside an assistant turn (content + <|im_end|>\n)
    assert trained_text(tok, enc) == "two.<|im_end|>\nfive.<|im_end|>\n"
    for i, (tid, lab) in enumerate(zip(enc.input_ids, enc.labels, strict=True)):
        assert lab in (-100, tid), i
    # the trained tokens form two contiguous runs, each right after "<|im_start|>assistant\n"
    runs, start = [], None
    for i, on in enumerate([*spans(enc), False]):
        if on and start is None:
            start = i
        if not on and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == 2
    for a, _ in runs:
        assert tok.decode(enc.input_ids[:a]).endswith("<|im_start|>assistant\n")


def test_instruction_rows_become_a_user_and_an_assistant_turn(tok) -> None:
    ex = to_example(1, {"instruction": "add", "input": "1 2", "output": "3"}, "instruction")
    assert ex.messages == [{"role": "user", "content": "add\n\n1 2"}, {"role": "assistant", "content": "3"}]
    assert trained_text(tok, encode(ex, tok, 512)) == "3<|im_end|>\n"


def test_prompt_completion_trains_on_the_completion_and_eos(tok) -> None:
    enc = encode(Example(1, prompt="what is two plus three? ", completion="five."), tok, 512)
    assert trained_text(tok, enc) == "five.</s>"
    assert tok.decode(enc.input_ids, skip_special_tokens=True) == "what is two plus three? five."


def test_text_rows_train_on_every_token(tok) -> None:
    enc = encode(Example(1, text="the lazy dog"), tok, 512)
    assert all(spans(enc))
    assert trained_text(tok, enc) == "the lazy dog</s>"


def test_fallback_template_when_the_tokenizer_has_none() -> None:
    bare = tiny_tokenizer(with_template=False)
    ensure_chat_template(bare)
    assert bare.chat_template == FALLBACK_CHAT_TEMPLATE
    ex = to_example(
        1,
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        "chat",
    )
    enc = encode(ex, bare, 512)
    assert trained_text(bare, enc) == "hello<|im_end|>\n</s>"


def test_truncation_and_statistics(tmp_path: Path, tok) -> None:
    p = tmp_path / "d.jsonl"
    rows = [{"prompt": "the quick brown fox " * n, "completion": "dog"} for n in (1, 2, 8)]
    p.write_text("\n".join(json.dumps(r) for r in rows))
    report = validate(str(p), tokenizer=tok, max_length=60)
    assert report.format == "prompt_completion" and report.rows == 3
    # the longest row loses its completion to truncation: an error naming its line
    assert [str(e) for e in report.errors] == ["line 3: no token left to train on within max_length=60"]
    assert report.truncated_share == pytest.approx(1 / 3)
    assert report.tokens["min"] < report.tokens["p50"] < report.tokens["max"]
    with pytest.raises(ValueError, match="1 invalid rows: line 3: no token left"):
        load_encoded(str(p), tok, max_length=60)
    assert len(load_encoded(str(p), tok, max_length=200)) == 3


def test_an_over_long_parquet_row_is_named_by_row(tmp_path: Path, tok) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(
        pa.table({"prompt": ["the quick brown fox " * n for n in (1, 8)], "completion": ["a", "b"]}), p
    )
    report = validate(str(p), tokenizer=tok, max_length=30)
    assert [str(e) for e in report.errors] == ["row 2: no token left to train on within max_length=30"]


def test_an_empty_file_is_invalid(tmp_path: Path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    report = validate(str(p))
    assert not report.ok and str(report.errors[0]) == "line 1: the file holds no rows"


def enc(n: int, tag: int) -> Encoded:
    return Encoded(tag, [tag] * n, [tag] * n, n, False)


def test_pack_concatenates_in_order_without_exceeding_the_length() -> None:
    packed = pack([enc(3, 1), enc(4, 2), enc(2, 3), enc(6, 4)], 8)
    assert [p.input_ids for p in packed] == [[1, 1, 1, 2, 2, 2, 2], [3, 3, 4, 4, 4, 4, 4, 4]]


def test_batcher_is_deterministic_by_seed_and_resumable() -> None:
    examples = [enc(1 + i % 3, i + 1) for i in range(10)]
    a = Batcher(examples, 3, seed=7, pad_id=0)
    straight = [a.next()["input_ids"].tolist() for _ in range(7)]  # crosses two epochs (3 per epoch)
    b = Batcher(examples, 3, seed=7, pad_id=0)
    first = [b.next()["input_ids"].tolist() for _ in range(4)]
    c = Batcher(examples, 3, seed=7, pad_id=0)
    c.load_state_dict(b.state_dict())
    rest = [c.next()["input_ids"].tolist() for _ in range(3)]
    assert first + rest == straight
    other = Batcher(examples, 3, seed=8, pad_id=0)
    assert [other.next()["input_ids"].tolist() for _ in range(7)] != straight
    with pytest.raises(ValueError, match=r"hyper.batch_size=11 is larger than the 10 training examples"):
        Batcher(examples, 11, seed=0, pad_id=0)


def test_collate_pads_right_with_masked_labels() -> None:
    batch = collate([Encoded(1, [5, 6, 7], [-100, 6, 7], 3, False), Encoded(2, [8], [8], 1, False)], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
