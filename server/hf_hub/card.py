"""The model card (``README.md``) of a pushed checkpoint, in the Hub's conventions: YAML metadata
(``base_model``, ``library_name``, ``datasets``, ``tags``, ``pipeline_tag``) then what was trained,
how, what it scored, and how to load it."""

from __future__ import annotations

import json
from typing import Any

import yaml


def _yaml(meta: dict[str, Any]) -> str:
    return yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def model_card(
    *,
    repo_id: str,
    kind: str,
    base_model: str,
    job_name: str,
    step: int,
    config: dict[str, Any],
    datasets: list[str],
    dataset_names: list[str],
    metrics: dict[str, Any],
) -> str:
    """The card's text.

    Args:
        kind: ``adapter`` (a PEFT LoRA adapter), ``merged`` (the adapter merged into the base) or
            ``full`` (a full fine-tune).
        datasets: Hub dataset ids the training data came from (for the metadata).
        dataset_names: every training dataset as the service names it.
        metrics: the checkpoint's metrics (``loss/train``, ``loss/val``, ...).
    """
    method = config.get("method") or {}
    objective = str(method.get("objective") or method.get("kind") or "sft")
    tuning = str(method.get("tuning") or ("lora" if kind != "full" else "full"))
    adapter = kind == "adapter"
    tags = ["roundhouse", objective, tuning, "text-generation"]
    if adapter:
        tags.insert(1, "peft")
    meta: dict[str, Any] = {"base_model": base_model, "library_name": "peft" if adapter else "transformers"}
    if datasets:
        meta["datasets"] = datasets
    meta["tags"] = list(dict.fromkeys(tags))
    meta["pipeline_tag"] = "text-generation"
    hyper = config.get("hyper") or {}
    what = {
        "adapter": f"a LoRA adapter (PEFT) for [`{base_model}`](https://huggingface.co/{base_model})",
        "merged": f"[`{base_model}`](https://huggingface.co/{base_model}) with a LoRA adapter merged in",
        "full": f"a full fine-tune of [`{base_model}`](https://huggingface.co/{base_model})",
    }[kind]
    lines = [
        "---",
        _yaml(meta),
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"This is {what}, trained with Roundhouse (job {job_name!r}, step {step}).",
        "",
        "## Training",
        "",
        f"- Method: {objective.upper()}, {tuning}"
        + (f" (r={method.get('lora_r')}, alpha={method.get('lora_alpha')})" if tuning == "lora" else ""),
        f"- Data: {', '.join(dataset_names) or 'not recorded'}",
        "",
        "| Hyperparameter | Value |",
        "| --- | --- |",
    ]
    lines += [f"| {key} | {_figure(value)} |" for key, value in sorted(hyper.items()) if value is not None]
    lines += ["", "## Results", ""]
    shown = {k: v for k, v in sorted(metrics.items()) if isinstance(v, int | float)}
    if shown:
        lines += ["| Metric | Value |", "| --- | --- |"]
        lines += [f"| {key} | {_figure(value)} |" for key, value in shown.items()]
    else:
        lines.append("No metrics were recorded at this step.")
    lines += ["", "## How to load it", "", "```python"]
    if adapter:
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base_model}")',
            f'model = PeftModel.from_pretrained(base, "{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        ]
    lines += [
        "```",
        "",
        "<!-- training config -->",
        "",
        "```json",
        json.dumps(config, indent=2, default=str),
        "```",
        "",
    ]
    return "\n".join(lines)
