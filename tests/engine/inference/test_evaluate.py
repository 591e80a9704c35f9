"""``engine.inference.evaluate`` against a hand computation on a tiny model: the loss and token accuracy of
one forward per row, exact match on short answers, samples, determinism, checkpoint folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.data.encode import encode
from engine.data.read import read_examples
from engine.inference.evaluate import SHORT_ANSWER_TOKENS, evaluate, evaluate_checkpoint
from engine.inference.generate import generate
from tests.engine.tiny import tiny_model, tiny_model_folder, tiny_tokenizer


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(question: str, answer: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="module")
def loaded() -> tuple[torch.nn.Module, object]:
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=max(96, len(tokenizer)))
    model.eval()
    return model, tokenizer


def by_hand(
    model: torch.nn.Module, tokenizer: object, path: Path, max_length: int = 1024
) -> tuple[float, float]:
    """Mean loss and token accuracy over every label token, one row at a time through the model's
    own loss (a mean over the row's label tokens, weighted back to a sum)."""
    _, _, examples, _ = read_examples(path)
    loss_sum, tokens, correct = 0.0, 0, 0
    for ex in examples:
        enc = encode(ex, tokenizer, max_length)
        ids, labels = torch.tensor([enc.input_ids]), torch.tensor([enc.labels])
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
        n = int((labels[0, 1:] != -100).sum())
        loss_sum += float(out.loss) * n
        predicted = out.logits[0, :-1].argmax(-1)
        keep = labels[0, 1:] != -100
        correct += int((predicted[keep] == labels[0, 1:][keep]).sum())
        tokens += n
    return loss_sum / tokens, correct / tokens


def test_metrics_equal_a_hand_computation_and_exact_match_counts_short_answers(
    loaded: tuple[torch.nn.Module, object], tmp_path: Path
) -> None:
    model, tokenizer = loaded
    # the model's own greedy answer to one question: that row must match, the others not
    said = generate(
        model, tokenizer, [{"role": "user", "content": "what is two plus three?"}], max_new_tokens=3
    )
    assert said.strip(), "the tiny model answered only whitespace; pick another question"
    long_answer = " ".join(["the quick brown fox"] * 20)
    rows = [
        chat("what is two plus three?", said),
        chat("what is one plus one?", "two"),
        chat("hello world", long_answer),  # longer than SHORT_ANSWER_TOKENS: no exact match
        chat("1 2 3", "4"),
    ]
    data = write(tmp_path / "rows.jsonl", rows)
    assert len(tokenizer(long_answer, add_special_tokens=False)["input_ids"]) > SHORT_ANSWER_TOKENS

    result = evaluate(model, tokenizer, data, max_rows=10, max_new_tokens=3, samples=2)
    loss, accuracy = by_hand(model, tokenizer, data)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert result["token_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert (result["rows"], result["rows_total"]) == (4, 4)
    assert (result["exact_match_rows"], result["exact_match_correct"]) == (3, 1)
    assert result["exact_match"] == pytest.approx(1 / 3)
    assert [s["line"] for s in result["samples"]] == [1, 2]
    first = result["samples"][0]
    assert (first["prompt"], first["reference"], first["output"], first["match"]) == (
        "what is two plus three?",
        said,
        said,
        True,
    )
    assert (
        evaluate(model, tokenizer, data, max_rows=10, max_new_tokens=3, samples=2) == result
    )  # deterministic

    # max_rows: the first rows in file order
    first_two = evaluate(model, tokenizer, data, max_rows=2, max_new_tokens=3, samples=5)
    loss2, _ = by_hand(model, tokenizer, write(tmp_path / "two.jsonl", rows[:2]))
    assert first_two["rows"] == 2 and first_two["loss"] == pytest.approx(loss2, rel=1e-5)
    assert len(first_two["samples"]) == 2


def test_prompt_completion_and_text_rows(loaded: tuple[torch.nn.Module, object], tmp_path: Path) -> None:
    model, tokenizer = loaded
    pc = write(
        tmp_path / "pc.jsonl", [{"prompt": "1 2 3 ", "completion": "4 5"}, {"prompt": "a", "completion": "b"}]
    )
    result = evaluate(model, tokenizer, pc, max_new_tokens=2)
    loss, accuracy = by_hand(model, tokenizer, pc)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["token_accuracy"] == pytest.approx(accuracy)
    assert result["exact_match_rows"] == 2 and [s["prompt"] for s in result["samples"]] == ["1 2 3 ", "a"]

    text = write(tmp_path / "text.jsonl", [{"text": "the quick brown fox"}])
    result = evaluate(model, tokenizer, text)
    assert result["loss"] == pytest.approx(by_hand(model, tokenizer, text)[0], rel=1e-5)
    assert result["exact_match"] is None and result["samples"] == []  # no reference answer


def test_bad_input_is_a_value_error(loaded: tuple[torch.nn.Module, object], tmp_path: Path) -> None:
    model, tokenizer = loaded
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="line 1"):
        evaluate(model, tokenizer, bad)
    with pytest.raises(ValueError, match="max_rows=0"):
        evaluate(model, tokenizer, write(tmp_path / "ok.jsonl", [chat("a", "b")]), max_rows=0)


def test_model_folder_and_adapter_checkpoints(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = tiny_model_folder(tmp_path / "base")
    data = write(tmp_path / "rows.jsonl", [chat("what is one plus one?", "two"), chat("1 2", "3")])
    full = evaluate_checkpoint(base, data, max_new_tokens=2, device="cpu")
    assert full["device"] == "cpu" and full["label_tokens"] > 0

    from transformers import AutoModelForCausalLM

    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():  # a non-zero adapter, so the scores differ from the base's
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)
    peft.save_pretrained(tmp_path / "adapter")
    tiny_tokenizer().save_pretrained(tmp_path / "adapter")
    adapted = evaluate_checkpoint(tmp_path / "adapter", data, base=base, max_new_tokens=2)
    assert adapted["device"] in ("cpu", "cuda:0")
    assert adapted["loss"] != pytest.approx(full["loss"])
