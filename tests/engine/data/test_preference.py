"""Preference rows (DPO): every accepted shape, errors by line, the two sequences' loss masks,
token counts over both answers, the refusal of the wrong method, and batches of pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.batches import Batcher, collate_pairs
from engine.data.encode import Encoded, EncodedPair, encode, encode_pair, load_encoded, load_pairs, validate
from engine.data.read import Example, detect_format, read_examples, to_example
from engine.errors import ConfigError
from tests.engine.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return tiny_tokenizer()


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def jsonl(tmp_path: Path, rows: list[Any], name: str = "pairs.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def trained(tok: Any, enc: Encoded) -> str:
    return str(tok.decode([t for t in enc.labels if t != -100]))


OPENAI = {
    "input": {"messages": [msg("user", "what is one plus one?")], "tools": [], "parallel_tool_calls": False},
    "preferred_output": [msg("assistant", "two.")],
    "non_preferred_output": [msg("assistant", "three.")],
}
TRL = {"prompt": "what is one plus one?", "chosen": "two.", "rejected": "three."}
HI = [msg("user", "what is one plus one?")]
WANT = Example(1, messages=[*HI, msg("assistant", "two.")], rejected="three.")


@pytest.mark.parametrize(
    "row",
    [
        OPENAI,
        {**{k: v for k, v in OPENAI.items() if k != "input"}, "prompt": "what is one plus one?"},
        TRL,
        {"prompt": HI, "chosen": [msg("assistant", "two.")], "rejected": [msg("assistant", "three.")]},
        {"chosen": [*HI, msg("assistant", "two.")], "rejected": [*HI, msg("assistant", "three.")]},
    ],
    ids=["openai", "openai-prompt-string", "trl-strings", "trl-messages", "trl-implicit-prompt"],
)
def test_every_shape_becomes_the_prompt_with_the_preferred_answer_and_the_rejected_one(row: dict) -> None:
    assert detect_format(row) == "preference"
    assert to_example(1, row, "preference") == WANT


def test_a_multi_turn_prompt_keeps_its_turns() -> None:
    turns = [msg("system", "be brief"), msg("user", "hi"), msg("assistant", "hello"), msg("user", "1+1?")]
    ex = to_example(
        3,
        {"chosen": [*turns, msg("assistant", "2")], "rejected": [*turns, msg("assistant", "3")]},
        "preference",
    )
    assert ex.messages == [*turns, msg("assistant", "2")] and ex.rejected == "3" and ex.line == 3


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
        ({"prompt": "p", "rejected": "a"}, "missing field 'chosen'"),
        ({"prompt": "p", "chosen": "a", "rejected": " "}, "field 'rejected' is empty"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "field 'prompt' is empty"),
        (
            {"prompt": 5, "chosen": "a", "rejected": "b"},
            "field 'prompt' must be a string or a list of messages, got int",
        ),
        (
            {"prompt": "p", "chosen": "same", "rejected": "same "},
            "'chosen' and 'rejected' are the same answer",
        ),
        (
            {"prompt": "p", "chosen": 3, "rejected": "b"},
            "field 'chosen' must be a string or a list with one assistant",
        ),
        ({"prompt": "p", "chosen": [], "rejected": "b"}, "field 'chosen' is empty"),
        (
            {"prompt": "p", "chosen": [msg("assistant", "a"), msg("assistant", "b")], "rejected": "c"},
            "field 'chosen' must hold one assistant message, got 2 messages",
        ),
        (
            {"prompt": "p", "chosen": [msg("user", "a")], "rejected": "c"},
            "chosen[0]: expected role 'assistant', got 'user'",
        ),
        ({"prompt": "p", "chosen": [msg("assistant", "")], "rejected": "c"}, "chosen[0].content is empty"),
        (
            {"prompt": [msg("user", "a"), msg("assistant", "b")], "chosen": "c", "rejected": "d"},
            "'prompt' must end with a user turn",
        ),
        (
            {"prompt": [msg("robot", "a")], "chosen": "c", "rejected": "d"},
            "prompt[0]: unknown role 'robot'",
        ),
        (
            {"prompt": [msg("user", "a"), msg("user", "b")], "chosen": "c", "rejected": "d"},
            "prompt[1]: expected role 'assistant', got 'user'",
        ),
        (
            {"input": "hi", "preferred_output": [msg("assistant", "a")], "non_preferred_output": "b"},
            "field 'input' must be an object with 'messages', got str",
        ),
        (
            {"input": {}, "preferred_output": [msg("assistant", "a")], "non_preferred_output": "b"},
            "missing field 'input.messages'",
        ),
        (
            {"input": {"messages": []}, "preferred_output": "a", "non_preferred_output": "b"},
            "field 'input.messages' is empty",
        ),
        (
            {
                "input": {"messages": [msg("system", "s")]},
                "preferred_output": "a",
                "non_preferred_output": "b",
            },
            "'input.messages' must end with a user turn",
        ),
        (
            {"input": {"messages": HI}, "prompt": "p", "preferred_output": "a", "non_preferred_output": "b"},
            "give the prompt as 'input' or as 'prompt', not both",
        ),
        (
            {"input": {"messages": HI}, "preferred_output": [msg("assistant", "a")]},
            "missing field 'non_preferred_output'",
        ),
        (
            {"prompt": "p", "chosen": "a", "non_preferred_output": "b"},
            "give the answers as 'chosen'/'rejected' or",
        ),
        ({"chosen": "a", "rejected": "b"}, "without a 'prompt', field 'chosen' must be a whole conversation"),
        (
            {
                "chosen": [*HI, msg("assistant", "a")],
                "rejected": [msg("user", "other"), msg("assistant", "b")],
            },
            "'chosen' and 'rejected' differ at message 0, before their last turn",
        ),
        (
            {
                "chosen": [*HI, msg("assistant", "a")],
                "rejected": [*HI, msg("assistant", "a"), msg("user", "more"), msg("assistant", "b")],
            },
            "'chosen' has 2 messages and 'rejected' 4",
        ),
        ({"chosen": [*HI, msg("assistant", "a")], "rejected": HI}, "rejected: no assistant turn"),
        (
            {
                "chosen": [*HI, msg("assistant", "a"), msg("user", "b")],
                "rejected": [*HI, msg("assistant", "c")],
            },
            "chosen: the last turn must be the assistant's",
        ),
    ],
)
def test_malformed_preference_rows_are_named_by_line(tmp_path: Path, bad: dict, message: str) -> None:
    fmt, rows, examples, errors = read_examples(jsonl(tmp_path, [TRL, bad, TRL]))
    assert fmt == "preference" and rows == 3 and [e.line for e in examples] == [1, 3]
    assert len(errors) == 1 and str(errors[0]).startswith(f"line 2: {message}"), errors


def test_csv_rows_are_prompt_chosen_rejected_strings(tmp_path: Path) -> None:
    p = tmp_path / "pairs.csv"
    p.write_text(
        'prompt,chosen,rejected\n"what is one plus one?",two.,three.\n"multi\nline",a,a\n"",x,y\np,,z\n'
    )
    fmt, rows, examples, errors = read_examples(p)
    assert fmt == "preference" and rows == 4 and examples == [Example(2, WANT.messages, rejected="three.")]
    assert [str(e) for e in errors] == [
        "line 3: 'chosen' and 'rejected' are the same answer; a pair needs two different ones",
        "line 5: field 'prompt' is empty",
        "line 6: field 'chosen' is empty",
    ]


def test_parquet_rows_hold_message_lists(tmp_path: Path, tok: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "pairs.parquet"
    table = pa.table(
        {
            "input": [{"messages": HI}, {"messages": HI}],
            "preferred_output": [[msg("assistant", "two.")], [msg("assistant", "same")]],
            "non_preferred_output": [[msg("assistant", "three.")], [msg("assistant", "same")]],
        }
    )
    pq.write_table(table, p)
    fmt, rows, examples, errors = read_examples(p)
    assert fmt == "preference" and rows == 2 and examples == [WANT]
    assert [str(e) for e in errors] == [
        "row 2: 'preferred_output' and 'non_preferred_output' are the same answer; "
        "a pair needs two different ones"
    ]


def test_each_sequence_trains_on_its_answer_alone(tok: Any) -> None:
    turns = [
        msg("system", "be brief"),
        msg("user", "one plus one?"),
        msg("assistant", "two."),
        msg("user", "and three?"),
    ]
    ex = to_example(
        7,
        {"chosen": [*turns, msg("assistant", "four.")], "rejected": [*turns, msg("assistant", "five.")]},
        "preference",
    )
    pair = encode_pair(ex, tok, 512)
    assert isinstance(pair, EncodedPair) and pair.line == 7
    # the prompt's own assistant turn ("two.") is context; only the answer and its end-of-turn marker train
    assert trained(tok, pair.chosen) == "four.<|im_end|>\n"
    assert trained(tok, pair.rejected) == "five.<|im_end|>\n"
    assert tok.decode(pair.chosen.input_ids) == tok.apply_chat_template(ex.messages, tokenize=False)
    rejected_text = tok.apply_chat_template([*turns, msg("assistant", "five.")], tokenize=False)
    assert tok.decode(pair.rejected.input_ids) == rejected_text
    # both continue the same rendered prompt, the answer right after "<|im_start|>assistant\n"
    for enc in (pair.chosen, pair.rejected):
        first = next(i for i, t in enumerate(enc.labels) if t != -100)
        assert tok.decode(enc.input_ids[:first]) == tok.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=True
        )
        assert all(lab in (-100, tid) for tid, lab in zip(enc.input_ids, enc.labels, strict=True))
    # encoding the row as one sequence gives the preferred one
    assert encode(ex, tok, 512) == pair.chosen


def test_a_tokenizer_without_a_template_gets_the_fallback(tmp_path: Path) -> None:
    bare = tiny_tokenizer(with_template=False)
    (pair,) = load_pairs(str(jsonl(tmp_path, [TRL])), bare, max_length=512)
    assert trained(bare, pair.chosen) == "two.<|im_end|>\n</s>"
    assert trained(bare, pair.rejected) == "three.<|im_end|>\n</s>"


def test_validation_counts_both_answers_and_names_the_truncated_one(tmp_path: Path, tok: Any) -> None:
    long = "the quick brown fox " * 6
    rows = [
        TRL,
        {"prompt": "p", "chosen": "a", "rejected": long},
        {"prompt": long * 3, "chosen": "a", "rejected": "b"},
    ]
    p = str(jsonl(tmp_path, rows))
    full = validate(p, tokenizer=tok, max_length=4096)
    pairs = load_pairs(p, tok, max_length=4096)
    lengths = [e.length for pr in pairs for e in (pr.chosen, pr.rejected)]
    assert full.ok and full.format == "preference" and full.rows == 3
    assert full.tokens["total"] == sum(lengths) and full.tokens["max"] == max(lengths)
    assert full.tokens["min"] == min(lengths)

    cut = max(pairs[1].chosen.length, pairs[1].rejected.length) - 3  # the rejected answer is cut short
    report = validate(p, tokenizer=tok, max_length=cut)
    assert [str(e) for e in report.errors] == [
        f"line 3: no token of the preferred answer left to train on within max_length={cut}",
        f"line 3: no token of the rejected answer left to train on within max_length={cut}",
    ]
    assert report.truncated_share == pytest.approx(3 / 6)  # the long rejected answer, both of line 3
    with pytest.raises(ConfigError, match=r"2 invalid rows: line 3: no token of the preferred") as caught:
        load_pairs(p, tok, max_length=cut)
    assert caught.value.field == "data.train"


def test_truncation_keeps_max_length(tmp_path: Path, tok: Any) -> None:
    p = str(jsonl(tmp_path, [{"prompt": "p", "chosen": "a", "rejected": "the quick brown fox " * 6}]))
    (whole,) = load_pairs(p, tok, max_length=4096)
    cut = whole.chosen.length + 1
    assert whole.rejected.length > cut + 4
    (pair,) = load_pairs(p, tok, max_length=cut)
    assert pair.rejected.input_ids == whole.rejected.input_ids[:cut] and pair.rejected.truncated
    assert (
        pair.rejected.labels == whole.rejected.labels[:cut] and pair.rejected.length == whole.rejected.length
    )
    assert pair.chosen == whole.chosen and not pair.chosen.truncated


def test_the_wrong_method_is_refused_with_the_one_that_fits(tmp_path: Path, tok: Any) -> None:
    pairs = str(jsonl(tmp_path, [TRL], "pairs.jsonl"))
    chat = str(jsonl(tmp_path, [{"messages": [*HI, msg("assistant", "two.")]}], "chat.jsonl"))
    with pytest.raises(
        ConfigError, match=r"data.validation: .*pairs.jsonl holds preference rows .*'dpo'"
    ) as c:
        load_encoded(pairs, tok, field="data.validation")
    assert c.value.field == "data.validation"
    with pytest.raises(
        ConfigError, match=r"data.train: .*chat.jsonl holds chat rows; method.kind 'dpo' trains"
    ) as c:
        load_pairs(chat, tok)
    assert c.value.field == "data.train"
    with pytest.raises(ConfigError, match=r"data.format='chat': method.kind 'dpo' trains on preference") as c:
        load_pairs(pairs, tok, fmt="chat")
    assert c.value.field == "data.format"
    with pytest.raises(ConfigError, match=r"data.format='preference' names preference rows") as c:
        load_encoded(chat, tok, fmt="preference")
    assert c.value.field == "data.format"
    with pytest.raises(ConfigError, match=r"unsupported file type") as c:
        load_pairs(str(tmp_path / "pairs.txt"), tok)
    assert c.value.field == "data.train"
    # a file of broken rows in the right shape lists them by line
    broken = str(jsonl(tmp_path, [TRL, {"prompt": "p", "chosen": "a"}, "{"], "broken.jsonl"))
    with pytest.raises(
        ConfigError, match=r"2 invalid rows: line 2: missing field 'rejected'; line 3: invalid JSON"
    ):
        load_pairs(broken, tok)


def pair(line: int, chosen: list[int], rejected: list[int]) -> EncodedPair:
    def seq(ids: list[int]) -> Encoded:
        return Encoded(line, ids, [-100, *ids[1:]], len(ids), False)

    return EncodedPair(line, seq(chosen), seq(rejected))


def test_collate_pairs_puts_each_chosen_before_its_rejected() -> None:
    batch = collate_pairs([pair(1, [5, 6, 7], [5, 8]), pair(2, [9], [9, 4, 4, 4])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [5, 8, 0, 0], [9, 0, 0, 0], [9, 4, 4, 4]]
    assert batch["labels"].tolist() == [
        [-100, 6, 7, -100],
        [-100, 8, -100, -100],
        [-100, -100, -100, -100],
        [-100, 4, 4, 4],
    ]
    assert torch.equal(batch["attention_mask"], (batch["input_ids"] != 0).long())


def test_batcher_counts_pairs_and_resumes() -> None:
    pairs = [pair(i + 1, [i + 1] * (1 + i % 3), [100 + i] * 2) for i in range(7)]
    a = Batcher(pairs, 2, seed=3, pad_id=0)
    assert a.steps_per_epoch == 3
    straight = [a.next()["input_ids"].tolist() for _ in range(5)]  # crosses an epoch
    assert all(len(b) == 4 for b in straight)
    for b in straight:  # rows 2i and 2i + 1 are one pair: the rejected ids are 100 + (chosen id - 1)
        for i in range(2):
            assert b[2 * i + 1][0] == 100 + b[2 * i][0] - 1
    b = Batcher(pairs, 2, seed=3, pad_id=0)
    first = [b.next()["input_ids"].tolist() for _ in range(2)]
    c = Batcher(pairs, 2, seed=3, pad_id=0)
    c.load_state_dict(b.state_dict())
    assert first + [c.next()["input_ids"].tolist() for _ in range(3)] == straight
    with pytest.raises(ValueError, match=r"hyper.batch_size=8 is larger than the 7 training pairs"):
        Batcher(pairs, 8, seed=0, pad_id=0)
    with pytest.raises(ValueError, match=r"1 of 2 examples are pairs"):
        Batcher([pairs[0], pairs[1].chosen], 1, seed=0, pad_id=0)  # type: ignore[list-item]
