"""Evaluating a checkpoint on a dataset: loss, perplexity, token accuracy, exact match, samples.

Rows are read and encoded exactly as training reads them (``engine.data``: chat template, loss
mask, ``max_length`` truncation), the first ``max_rows`` of the file in order. Over every label
token (a token training takes the loss on) of those rows:

- ``loss``: the mean cross-entropy of predicting it from the tokens before it;
- ``perplexity``: ``exp(loss)``;
- ``token_accuracy``: the share whose argmax prediction is that token.

Exact match: a row with a reference answer (the last assistant turn of a chat or instruction
row; the completion of a prompt/completion row; text rows have none) whose reference is **short**
(at most ``SHORT_ANSWER_TOKENS`` tokens, tokenized without special tokens) and whose answer was
not cut by ``max_length`` is answered by greedy generation from the tokens before its answer
(at most ``max_new_tokens``); it matches when the generated text equals the reference, both
whitespace-trimmed. The first ``samples`` rows with a reference are generated too and returned
with their prompt and reference. Everything is deterministic (no sampling, rows in file order).

Rows with images (a vision-language model's data) are encoded by the model's processor as training
encodes them, and each forward and generation takes the row's image tensors
(``engine.inference.images``: ``image_inputs``, ``token_types``); a sample shows its images as
thumbnails. A text model refuses them, naming the row.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from engine.data.encode import encode, ensure_chat_template
from engine.data.images import IMAGE_MARK, thumbnail
from engine.data.read import read_examples
from engine.inference.generate import (
    base_of,
    complete,
    load_for_inference,
    load_processor,
    prompt_and_reference,
)
from engine.inference.images import image_inputs, on_device, token_types
from engine.vision.processing import PROCESSOR_FILES

SHORT_ANSWER_TOKENS = 32


def _answer_start(labels: list[int]) -> int | None:
    """Where the last run of label tokens starts (the reference answer), None without one."""
    end = len(labels)
    while end > 0 and labels[end - 1] == -100:
        end -= 1
    if end == 0:
        return None
    start = end
    while start > 0 and labels[start - 1] != -100:
        start -= 1
    return start


def _row_scores(
    model: Any, ids: list[int], labels: list[int], images: dict[str, torch.Tensor]
) -> tuple[float, int, int]:
    """(summed loss, label tokens, correct argmax predictions) of one encoded row (``images``: its
    image tensors)."""
    device = next(model.parameters()).device
    inputs = torch.tensor([ids], device=device)
    target = torch.tensor(labels[1:], device=device)  # position t predicts token t + 1
    with torch.no_grad():
        out = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), **on_device(images, model))
        logits = out.logits[0, :-1].float()
    keep = target != -100
    if not bool(keep.any()):
        return 0.0, 0, 0
    loss = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    correct = int((logits[keep].argmax(-1) == target[keep]).sum())
    return float(loss), int(keep.sum()), correct


def evaluate(
    model: Any,
    tokenizer: Any,
    path: str | Path,
    *,
    max_rows: int = 200,
    max_new_tokens: int = 64,
    samples: int = 5,
    max_length: int = 1024,
    processor: Any = None,
    image_store: str | Path | None = None,
) -> dict[str, Any]:
    """Score a loaded model (``model.eval()``) on the first ``max_rows`` rows of a dataset file.

    Args:
        path: a JSONL, CSV or Parquet file in one of the row shapes ``engine.data`` reads.
        processor: a VLM's processor (``load_processor``), for rows with images.
        image_store: the content-addressed image store the rows' ``sha256:`` images are in.
        max_new_tokens: the longest generated answer (exact match and samples).
        samples: how many rows with a reference answer to return generated, with their references.
        max_length: rows are truncated to this many tokens, as in training.

    Returns:
        ``rows``, ``rows_total``, ``label_tokens``, ``loss``, ``perplexity``, ``token_accuracy``,
        ``exact_match`` (a share, None without a short answer), ``exact_match_rows``,
        ``exact_match_correct``, ``short_answer_tokens``, ``max_new_tokens``, ``max_length``,
        ``image_rows`` (rows with images) and ``samples`` (``line``, ``prompt``, ``reference``,
        ``output``, ``short``, ``match``, ``images``: thumbnails as data URLs).

    Raises:
        ValueError: an unsupported file, invalid rows (by line), a bad limit, no label token, or
            a row with images for a text model (naming the row).
    """
    if max_rows < 1 or max_new_tokens < 1 or samples < 0:
        raise ValueError(
            f"max_rows={max_rows} and max_new_tokens={max_new_tokens} must be >= 1, samples >= 0"
        )
    _, total, examples, errors = read_examples(path, image_store=image_store)
    if errors:
        raise ValueError(f"{Path(path).name}: " + "; ".join(str(e) for e in errors[:10]))
    ensure_chat_template(tokenizer)
    loss_sum, tokens, correct = 0.0, 0, 0
    short_rows = short_correct = image_rows = 0
    shown: list[dict[str, Any]] = []
    for ex in examples[:max_rows]:
        try:
            enc = encode(ex, processor if processor is not None and ex.images else tokenizer, max_length)
            images = image_inputs(processor, model, enc.images) if enc.images else {}
        except ValueError as exc:
            raise ValueError(f"{Path(path).name}: line {ex.line}: {exc}") from None
        image_rows += bool(enc.images)
        types = token_types(model, torch.tensor([enc.input_ids])) if images else {}
        row_loss, row_tokens, row_correct = _row_scores(model, enc.input_ids, enc.labels, images | types)
        loss_sum, tokens, correct = loss_sum + row_loss, tokens + row_tokens, correct + row_correct
        found = prompt_and_reference(ex)
        start = _answer_start(enc.labels)
        if found is None or start is None:
            continue
        prompt, reference = found
        whole = not enc.truncated
        short = (
            whole and len(tokenizer(reference, add_special_tokens=False)["input_ids"]) <= SHORT_ANSWER_TOKENS
        )
        if not short and len(shown) >= samples:
            continue
        # the answer comes after every image (images are in user turns): the prompt has them all
        inputs = images | (token_types(model, torch.tensor([enc.input_ids[:start]])) if images else {})
        output = complete(
            model, tokenizer, enc.input_ids[:start], max_new_tokens=max_new_tokens, inputs=inputs
        )
        match = output.strip() == reference.strip() if short else None
        short_rows += short
        short_correct += bool(match)
        if len(shown) < samples:
            last = prompt[-1]["content"].replace(IMAGE_MARK, "<image>") if prompt else ""
            shown.append(
                {
                    "line": ex.line,
                    "prompt": last,
                    "reference": reference,
                    "output": output,
                    "short": short,
                    "match": match,
                    "images": [thumbnail(b) for b in enc.images],
                }
            )
    if tokens == 0:
        raise ValueError(f"{Path(path).name}: no label token in the first {max_rows} rows")
    loss = loss_sum / tokens
    return {
        "rows": min(max_rows, len(examples)),
        "rows_total": total,
        "label_tokens": tokens,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # past e^700 a float overflows
        "token_accuracy": correct / tokens,
        "exact_match": short_correct / short_rows if short_rows else None,
        "exact_match_rows": short_rows,
        "exact_match_correct": short_correct,
        "short_answer_tokens": SHORT_ANSWER_TOKENS,
        "max_new_tokens": max_new_tokens,
        "max_length": max_length,
        "image_rows": image_rows,
        "samples": shown,
    }


def pick_device(model: Any) -> str:
    """``cuda:0`` when there is a GPU whose free memory holds the model with a third to spare
    (activations, the generation cache), else ``cpu``."""
    if not torch.cuda.is_available():
        return "cpu"
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(0)
    return "cuda:0" if need * 4 // 3 < free else "cpu"


def _processor(checkpoint: str | Path, base: str | Path | None) -> Any:
    """The processor of a checkpoint's VLM (None for a text model): a full checkpoint's own, else
    (a LoRA adapter, or a folder without processor files) its base's."""
    from engine.model.export import is_adapter

    if base is None and is_adapter(checkpoint):
        base = base_of(checkpoint)
    if base is not None and (is_adapter(checkpoint) or not (Path(checkpoint) / PROCESSOR_FILES[0]).is_file()):
        return load_processor(base)
    return load_processor(checkpoint)


def evaluate_checkpoint(
    checkpoint: str | Path,
    data: str | Path,
    *,
    base: str | Path | None = None,
    device: str | None = None,
    image_store: str | Path | None = None,
    **limits: Any,
) -> dict[str, Any]:
    """Load a checkpoint (a model folder, or a LoRA adapter on ``base``, else on the base model
    its run recorded) and ``evaluate`` it on ``data``; ``limits`` are ``evaluate``'s keywords.
    A VLM's rows with images are read with its processor (the checkpoint's, or its base's).

    Args:
        device: where to run; None picks one (``pick_device``).
        image_store: the image store of the data's ``sha256:`` images.

    Returns:
        ``evaluate``'s result plus ``device``.
    """
    model, tokenizer = (
        load_for_inference(base, adapter=checkpoint) if base is not None else load_for_inference(checkpoint)
    )
    processor = _processor(checkpoint, base)
    device = device or pick_device(model)
    model.to(device)
    result = evaluate(model, tokenizer, data, processor=processor, image_store=image_store, **limits)
    result["device"] = device
    return result
