"""The model card (``README.md``) of a pushed checkpoint, in the Hub's conventions: YAML metadata
(``base_model``, ``library_name``, ``datasets``, ``tags``, ``pipeline_tag``) then what was trained,
how, what it scored, and how to load it (``transformers``, ``peft``, or llama.cpp and Ollama for a
GGUF)."""

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
    variant: str | None = None,
    files: list[str] | None = None,
) -> str:
    """The card's text.

    Args:
        kind: what the repo holds (``ExportFormat.what``): ``adapter`` (a PEFT LoRA adapter),
            ``merged`` (the adapter merged into the base), ``full`` (a full fine-tune) or ``gguf``
            (a GGUF folder for llama.cpp and Ollama: the model, a LoRA checkpoint's adapter alone,
            a Modelfile).
        datasets: Hub dataset ids the training data came from (for the metadata).
        dataset_names: every training dataset as the service names it.
        metrics: the checkpoint's metrics (``loss/train``, ``loss/val``, ...).
        variant: the format's variant (a GGUF's quantization).
        files: the repo's files (a GGUF's card names its model and adapter files).
    """
    method = config.get("method") or {}
    objective = str(method.get("objective") or method.get("kind") or "sft")
    tuning = str(method.get("tuning") or ("lora" if kind != "full" else "full"))
    adapter, gguf = kind == "adapter", kind == "gguf"
    tags = ["roundhouse", objective, tuning, "text-generation"]
    if adapter:
        tags.insert(1, "peft")
    if gguf:
        tags[1:1] = ["gguf", *([variant] if variant else []), "llama.cpp", "ollama"]
    library = "peft" if adapter else "gguf" if gguf else "transformers"
    meta: dict[str, Any] = {"base_model": base_model, "library_name": library}
    if datasets:
        meta["datasets"] = datasets
    meta["tags"] = list(dict.fromkeys(tags))
    meta["pipeline_tag"] = "text-generation"
    ggufs = sorted(f for f in files or () if f.endswith(".gguf"))
    lora = [f for f in ggufs if f.startswith("adapter")]  # a LoRA checkpoint's adapter alone
    model_files = [f for f in ggufs if f not in lora] or ["model.gguf"]
    hyper = config.get("hyper") or {}
    what = {
        "adapter": f"a LoRA adapter (PEFT) for [`{base_model}`](https://huggingface.co/{base_model})",
        "merged": f"[`{base_model}`](https://huggingface.co/{base_model}) with a LoRA adapter merged in",
        "full": f"a full fine-tune of [`{base_model}`](https://huggingface.co/{base_model})",
        "gguf": f"a GGUF{f' ({variant})' if variant else ''} for llama.cpp and Ollama of a fine-tune of"
        f" [`{base_model}`](https://huggingface.co/{base_model})",
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
    lines += ["", "## How to load it", ""]
    if gguf:
        lines += _gguf_usage(
            repo_id, model=model_files[0], lora=lora, base_model=base_model, files=files or []
        )
    elif adapter:
        lines += [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base_model}")',
            f'model = PeftModel.from_pretrained(base, "{repo_id}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        ]
    else:
        lines += [
            "```python",
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


def _gguf_usage(repo_id: str, *, model: str, lora: list[str], base_model: str, files: list[str]) -> list[str]:
    """How to run a pushed GGUF folder: download it, then llama.cpp or Ollama (its Modelfile).
    The lines end inside an open code block, as the other loaders' do."""
    name = repo_id.split("/")[-1]
    lines = [
        f"`{model}` is the model"
        + (f"; `{lora[0]}` is the LoRA adapter alone, for a GGUF of `{base_model}`" if lora else "")
        + (", and `Modelfile` is for Ollama" if "Modelfile" in files else "")
        + ".",
        "",
        "```bash",
        f"hf download {repo_id} --local-dir {name}",
        f"llama-cli -m {name}/{model} -cnv",
    ]
    if lora:
        lines.append(
            f"llama-cli -m base.gguf --lora {name}/{lora[0]} -cnv  # the adapter on a GGUF of the base"
        )
    if "Modelfile" in files:
        lines.append(f"cd {name} && ollama create {name.lower()} -f Modelfile && ollama run {name.lower()}")
    return lines
