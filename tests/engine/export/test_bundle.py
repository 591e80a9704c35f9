"""``roundhouse export CKPT --gguf``: the GGUF folder of a checkpoint, with its Modelfile."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from engine.commands.cli import main
from engine.export.modelfile import modelfile, stop_words, system_prompt
from tests.engine.tiny import tiny_model, tiny_tokenizer


def lora_checkpoint(root: Path) -> tuple[Path, Path]:
    """A tiny Llama base folder and a LoRA checkpoint of it whose run recorded chat data."""
    from peft import LoraConfig, get_peft_model

    tokenizer = tiny_tokenizer()
    tokenizer.init_kwargs["gguf_pre_tokenizer"] = "gpt-2"  # in no llama.cpp table: named (test_gguf.py)
    base = root / "base"
    model = tiny_model("llama", blocks=2, vocab_size=len(tokenizer))
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    checkpoint = root / "run" / "checkpoints" / "step_000003"
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).save_pretrained(
        checkpoint
    )
    tokenizer.save_pretrained(checkpoint)
    data = root / "train.jsonl"
    system = {"role": "system", "content": "Answer with one number."}
    rows = [{"messages": [system, {"role": "user", "content": q}]} for q in ("1 + 1?", "2 + 2?")]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (checkpoint / "state").mkdir()
    (checkpoint / "state" / "trainer.json").write_text(
        json.dumps({"step": 3, "base_model": str(base), "config": {"data": {"train": str(data)}}})
    )
    return base, checkpoint


def test_export_gguf_of_a_lora_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, checkpoint = lora_checkpoint(tmp_path)
    out = tmp_path / "gguf"
    assert main(["export", str(checkpoint), "--out", str(out), "--gguf", "--quant", "q8_0"]) == 0
    assert "model-q8_0.gguf, adapter-f32.gguf, Modelfile" in capsys.readouterr().out
    model = gguf.GGUFReader(out / "model-q8_0.gguf")
    assert model.fields["general.type"].contents() == "model"
    assert gguf.GGUFReader(out / "adapter-f32.gguf").fields["adapter.lora.alpha"].contents() == 8
    text = (out / "Modelfile").read_text()
    assert text.splitlines()[0] == "FROM ./model-q8_0.gguf"
    assert 'PARAMETER stop "<|im_end|>"' in text and 'PARAMETER stop "</s>"' in text
    assert 'SYSTEM """Answer with one number."""' in text


def test_export_gguf_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, checkpoint = lora_checkpoint(tmp_path)
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "x"), "--gguf", "--merged"]) == 2
    assert "--gguf and --merged" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(checkpoint), "--out", str(tmp_path / "x"), "--gguf", "--quant", "q3"])


def test_modelfile_pieces() -> None:
    assert stop_words(chat_template="<|im_start|>x<|im_end|>", eos="<|im_end|>") == ["<|im_end|>"]
    assert system_prompt([{"messages": [{"role": "user", "content": "hi"}]}]) is None
    mixed = [{"messages": [{"role": "system", "content": s}]} for s in ("a", "b")]
    assert system_prompt(mixed) is None
    text = modelfile("m.gguf", chat_template=None, eos="</s>", system='say """hi"""', context_length=8)
    assert text.splitlines() == [
        "FROM ./m.gguf",
        'PARAMETER stop "</s>"',
        "PARAMETER num_ctx 8",
        'SYSTEM """say \\"\\"\\"hi\\"\\"\\""""',
    ]
