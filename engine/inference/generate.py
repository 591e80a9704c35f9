"""Quick checks of a checkpoint: greedy generation and exact-match accuracy on a held-out set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.data.read import Example, read_examples
from engine.inference.images import on_device
from engine.model.export import is_adapter, load_export
from engine.model.loading import load_model, load_processor_for, load_tokenizer
from engine.training.checkpoint_layout import read_trainer_state


def base_of(checkpoint: str | Path) -> Path | None:
    """The base model folder a checkpoint's run recorded (``state/trainer.json``), if any."""
    state = read_trainer_state(checkpoint)
    return Path(state["base_model"]) if state is not None and state.get("base_model") else None


def load_for_inference(model: str | Path, *, adapter: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a model folder, a checkpoint folder, or a base plus an adapter."""
    model = Path(model)
    if adapter is not None:
        loaded = load_export(adapter, base=model)
        tokenizer = load_tokenizer(adapter)
    elif is_adapter(model):
        base = base_of(model)
        if base is None:
            raise ValueError(f"{model} is a LoRA adapter without a recorded base model: pass --base")
        loaded = load_export(model, base=base)
        tokenizer = load_tokenizer(model)
    else:
        loaded = load_model(model)
        tokenizer = load_tokenizer(model)
    loaded.eval()
    return loaded, tokenizer


def load_processor(model: str | Path) -> Any:
    """The processor of a VLM folder (a base model, a full fine-tuned export), which a LoRA
    adapter on it uses too; None for a text model.

    Raises:
        ConfigError: (``model.path``) a vision-language model the engine does not support.
    """
    return load_processor_for(Path(model))


def generate(
    model: Any, tokenizer: Any, messages: list[dict[str, str]] | str, *, max_new_tokens: int = 64
) -> str:
    """Greedy completion of a conversation (or a single user prompt), special tokens removed."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return complete(model, tokenizer, ids, max_new_tokens=max_new_tokens)


def complete(
    model: Any,
    tokenizer: Any,
    ids: list[int],
    *,
    max_new_tokens: int = 64,
    inputs: dict[str, torch.Tensor] | None = None,
) -> str:
    """Greedy continuation of prompt token ids (on the model's device), special tokens removed;
    ``inputs``: a VLM prompt's image tensors (``engine.inference.images``)."""
    prompt = torch.tensor([ids], device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            **on_device(inputs or {}, model),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))


def prompt_and_reference(example: Example) -> tuple[list[dict[str, str]], str] | None:
    """A row's prompt (every turn before the last assistant turn; a prompt/completion row's prompt
    as a user turn) and its reference answer (that turn; the completion); None for a text row."""
    if example.messages is not None:
        return example.messages[:-1], example.messages[-1]["content"]
    if example.prompt is not None and example.completion is not None:
        return [{"role": "user", "content": example.prompt}], example.completion
    return None


def exact_match(model: Any, tokenizer: Any, path: str | Path, *, max_new_tokens: int = 32) -> dict[str, Any]:
    """Share of held-out rows whose generated answer equals the reference (whitespace-trimmed).

    The prompt is every turn before the last assistant turn; the reference is that turn.
    """
    _, _, examples, errors = read_examples(path)
    if errors:
        raise ValueError(f"{path}: " + "; ".join(str(e) for e in errors[:10]))
    correct = 0
    samples: list[dict[str, Any]] = []
    for ex in examples:
        if ex.images:
            raise ValueError(f"{path}: line {ex.line}: a row with images: evaluate it (evaluate_checkpoint)")
        found = prompt_and_reference(ex)
        if found is None:
            raise ValueError(f"{path}: line {ex.line}: text rows have no reference answer")
        prompt, reference = found
        answer = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
        ok = answer.strip() == reference.strip()
        correct += ok
        if len(samples) < 5:
            samples.append({"prompt": prompt[-1]["content"], "expected": reference, "got": answer, "ok": ok})
    return {
        "rows": len(examples),
        "correct": correct,
        "accuracy": correct / max(len(examples), 1),
        "samples": samples,
    }
