"""``engine.inference.evaluate`` on rows with images, for each tiny VLM family: the prompt a row's
answer is generated from is the chat prompt inference renders (ids and image tensors alike); the
loss and token accuracy equal the model's own loss on the processor's inputs; exact match and
samples come from greedy generation with the row's images; ``sha256:`` images are read from the
image store; a text model refuses image rows naming the line."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.data.encode import encode
from engine.data.images import IMAGE_MARK
from engine.data.read import read_examples
from engine.inference.evaluate import evaluate
from engine.inference.images import chat_prompt, image_inputs, token_types
from tests.engine.tiny import tiny_model, tiny_tokenizer
from tests.engine.tiny_vision import VLM_FAMILIES, png, tiny_processor, tiny_vlm


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def row(image: str, question: str, answer: str) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    row(url(png(24, 16, 1)), "what is it?", "a cat"),
    {"messages": [{"role": "user", "content": "no image"}, {"role": "assistant", "content": "fine"}]},
    row(url(png(30, 20, 2)), "and this one?", "a dog"),
]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_image_rows_score_as_the_model_s_own_loss_and_generate_with_their_images(
    family: str, tmp_path: Path
) -> None:
    model, processor = tiny_vlm(family).eval(), tiny_processor(family)
    tokenizer = processor.tokenizer
    path = write(tmp_path / "eval.jsonl", ROWS)
    result = evaluate(model, tokenizer, path, processor=processor, max_new_tokens=6, samples=3)
    assert result["rows"] == 3 and result["image_rows"] == 2

    _, _, examples, _ = read_examples(path)
    loss_sum, tokens, correct, outputs = 0.0, 0, 0, []
    for ex in examples:
        enc = encode(ex, processor if ex.images else tokenizer, 1024)
        ids = torch.tensor([enc.input_ids])
        inputs = image_inputs(processor, model, enc.images) | token_types(model, ids) if enc.images else {}
        start = next(i for i, label in enumerate(enc.labels) if label != -100)
        # the answer's prompt is what the chat renders for the turns before it, images included
        messages = [
            {
                "role": m["role"],
                "content": [
                    {"type": "image", "image": next(images)}
                    if piece == IMAGE_MARK
                    else {"type": "text", "text": piece}
                    for piece in split(m["content"])
                ],
            }
            for images in [iter(enc.images)]
            for m in (ex.messages or [])[:-1]
        ]
        prompt = chat_prompt(tokenizer, messages, processor=processor)
        assert prompt.ids == enc.input_ids[:start]
        assert prompt.inputs.keys() == inputs.keys()  # the processor's, and those made from ids alone
        if enc.images:  # the prompt's: the row's image tensors, its token types cut to the prompt
            cut = image_inputs(processor, model, enc.images) | token_types(model, torch.tensor([prompt.ids]))
            assert all(torch.equal(prompt.inputs[k], cut[k]) for k in cut)
        else:
            assert not prompt.inputs
        labels = torch.tensor([enc.labels])
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels, **inputs)
        n = int((labels[0, 1:] != -100).sum())
        loss_sum += float(out.loss) * n
        keep = labels[0, 1:] != -100
        correct += int((out.logits[0, :-1].argmax(-1)[keep] == labels[0, 1:][keep]).sum())
        tokens += n
        x = torch.tensor([prompt.ids])
        with torch.no_grad():
            made = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                **prompt.inputs,
                max_new_tokens=6,
                do_sample=False,
            )
        outputs.append(tokenizer.decode(made[0, len(prompt.ids) :], skip_special_tokens=True))
    assert result["loss"] == pytest.approx(loss_sum / tokens, rel=1e-5)
    assert result["token_accuracy"] == pytest.approx(correct / tokens)
    assert [s["output"] for s in result["samples"]] == outputs
    first = result["samples"][0]
    assert first["prompt"] == "<image>what is it?" and len(first["images"]) == 1
    assert first["images"][0].startswith("data:image/")
    assert result["samples"][1]["images"] == []


def split(text: str) -> list[str]:
    """A message's text cut at its image marks, the marks kept as pieces."""
    pieces: list[str] = []
    for i, piece in enumerate(text.split(IMAGE_MARK)):
        if i:
            pieces.append(IMAGE_MARK)
        if piece:
            pieces.append(piece)
    return pieces


def test_sha256_images_come_from_the_store_and_a_text_model_refuses_image_rows(tmp_path: Path) -> None:
    image = png(16, 16, 3)
    digest = hashlib.sha256(image).hexdigest()
    store = tmp_path / "images"
    (store / digest[:2]).mkdir(parents=True)
    (store / digest[:2] / digest).write_bytes(image)
    path = write(tmp_path / "eval.jsonl", [row(f"sha256:{digest}", "what is it?", "a cat")])
    model, processor = tiny_vlm("idefics3").eval(), tiny_processor("idefics3")
    stored = evaluate(
        model, processor.tokenizer, path, processor=processor, image_store=store, max_new_tokens=4
    )
    inline = evaluate(
        model,
        processor.tokenizer,
        write(tmp_path / "inline.jsonl", [row(url(image), "what is it?", "a cat")]),
        processor=processor,
        max_new_tokens=4,
    )
    assert (
        stored["loss"] == inline["loss"] and stored["samples"][0]["output"] == inline["samples"][0]["output"]
    )
    with pytest.raises(ValueError, match=r"line 1.*image store"):
        evaluate(model, processor.tokenizer, path, processor=processor)
    tokenizer = tiny_tokenizer()
    text_model = tiny_model("llama", vocab_size=max(96, len(tokenizer))).eval()
    with pytest.raises(ValueError, match=r"eval\.jsonl: line 1: .*text model"):
        evaluate(text_model, tokenizer, path, image_store=store)


def test_a_vlm_checkpoint_folder_and_a_lora_adapter_on_one_evaluate_with_their_processor(
    tmp_path: Path,
) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    from engine.inference.evaluate import evaluate_checkpoint
    from tests.engine.tiny_vision import tiny_vlm_folder

    base = tiny_vlm_folder(tmp_path / "base", "qwen2_5_vl")
    path = write(tmp_path / "eval.jsonl", ROWS)
    torch.manual_seed(3)
    lora = LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    get_peft_model(tiny_vlm("qwen2_5_vl"), lora).save_pretrained(str(tmp_path / "adapter"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # as an export has
        if (base / name).is_file():
            (tmp_path / "adapter" / name).write_bytes((base / name).read_bytes())
    processor = tiny_processor("qwen2_5_vl")
    whole = evaluate_checkpoint(base, path, device="cpu", max_new_tokens=4)
    assert whole["image_rows"] == 2
    assert whole["loss"] == pytest.approx(
        evaluate(
            tiny_vlm("qwen2_5_vl").eval(), processor.tokenizer, path, processor=processor, max_new_tokens=4
        )["loss"],
        rel=1e-6,
    )
    tuned = evaluate_checkpoint(tmp_path / "adapter", path, base=base, device="cpu", max_new_tokens=4)
    reference = PeftModel.from_pretrained(tiny_vlm("qwen2_5_vl"), str(tmp_path / "adapter")).eval()
    expected = evaluate(reference, processor.tokenizer, path, processor=processor, max_new_tokens=4)
    assert tuned["loss"] == pytest.approx(expected["loss"], rel=1e-6) and tuned["loss"] != whole["loss"]


def test_the_quick_exact_match_check_sends_image_rows_to_evaluate(tmp_path: Path) -> None:
    from engine.inference.generate import exact_match

    model, processor = tiny_vlm("gemma3_vl").eval(), tiny_processor("gemma3_vl")
    with pytest.raises(ValueError, match=r"line 1: a row with images: evaluate it"):
        exact_match(model, processor.tokenizer, write(tmp_path / "eval.jsonl", ROWS))
