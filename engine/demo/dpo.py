"""The DPO demo: a few preference steps, and the answers' log-likelihoods before and after.

The model (the demo model, or any model folder) is scored on preference pairs — inventory
questions with the right count preferred over another item's count — then trained a few DPO
steps on the training pairs, and scored again with the trained weights. DPO raises the preferred
answer's log-likelihood relative to the rejected one's: the margin ``log p(chosen) - log
p(rejected)`` grows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import demo
from engine.data.batches import collate_pairs
from engine.data.encode import EncodedPair, load_pairs
from engine.metrics import NullSink, Sink
from engine.model.loss import sequence_logps


@dataclass
class PairScores:
    """The log-likelihoods of some pairs' answers (``[P]`` each) and their prompts."""

    prompts: list[str]
    chosen_answers: list[str]
    rejected_answers: list[str]
    chosen: torch.Tensor
    rejected: torch.Tensor

    @property
    def margin(self) -> float:
        """The mean of ``log p(chosen) - log p(rejected)``."""
        return float((self.chosen - self.rejected).mean())


@dataclass
class DemoResult:
    """Scores before and after training, on the training pairs shown and the held-out ones."""

    train_before: PairScores
    train_after: PairScores
    heldout_before: PairScores
    heldout_after: PairScores
    steps: int
    seconds: float
    checkpoint: Path | None


def demo_config(
    model: str,
    *,
    steps: int,
    workers: int,
    output_dir: str | Path,
    tuning: str = "lora",
    train: Path = demo.PREFERENCE_TRAIN,
    learning_rate: float | None = None,
    beta: float = 0.1,
) -> dict[str, Any]:
    """The demo run's ``TrainConfig`` mapping: ``steps`` DPO steps of 4 pairs."""
    lr = learning_rate if learning_rate is not None else (5e-4 if tuning == "lora" else 1e-5)
    return {
        "model": {"path": model},
        "data": {"train": str(train), "max_length": 128},
        "method": {"kind": "dpo", "dpo_tuning": tuning, "beta": beta, "lora_r": 16, "lora_alpha": 32},
        "hyper": {"max_steps": steps, "batch_size": 4, "learning_rate": lr, "schedule": "constant"},
        "engine": {"devices": ["cpu"] * workers, "num_microbatches": 2},
        "checkpoint": {"every_steps": steps, "keep_last": 1},
        "output_dir": str(output_dir),
    }


def score(model: Any, tokenizer: Any, pairs: list[EncodedPair], rows: list[dict[str, Any]]) -> PairScores:
    """The summed log-probability of each answer after its prompt, with a plain forward."""
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    model.eval()
    with torch.no_grad():
        batch = collate_pairs(pairs, pad)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logps = sequence_logps(logits, batch["labels"])
    by_line = {r["line"]: r for r in rows}
    shown = [by_line[p.line] for p in pairs]
    return PairScores(
        prompts=[str(r["prompt"]) for r in shown],
        chosen_answers=[str(r["chosen"]) for r in shown],
        rejected_answers=[str(r["rejected"]) for r in shown],
        chosen=logps[0::2],
        rejected=logps[1::2],
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    import json

    lines = path.read_text(encoding="utf-8").splitlines()
    return [{**json.loads(text), "line": i} for i, text in enumerate(lines, start=1) if text.strip()]


def run_demo(
    model_folder: Path,
    *,
    steps: int,
    workers: int,
    output_dir: str | Path,
    tuning: str = "lora",
    shown: int = 8,
    train: Path = demo.PREFERENCE_TRAIN,
    heldout: Path = demo.PREFERENCE_HELDOUT,
    learning_rate: float | None = None,
    beta: float = 0.1,
    sink: Sink | None = None,
) -> DemoResult:
    """Score, train ``steps`` DPO steps, score again.

    Args:
        model_folder: the base model folder.
        shown: how many training pairs to score (the first of the file).

    Raises:
        ValueError: the run wrote no checkpoint, or a bad configuration (``ConfigError``).
    """
    from engine.config import TrainConfig
    from engine.inference.generate import load_for_inference
    from engine.training.run import train as train_run

    model, tokenizer = load_for_inference(model_folder)
    config = TrainConfig.parse(
        demo_config(
            str(model_folder),
            steps=steps,
            workers=workers,
            output_dir=output_dir,
            tuning=tuning,
            train=train,
            learning_rate=learning_rate,
            beta=beta,
        )
    )
    max_length = config.data.max_length
    train_pairs = load_pairs(str(train), tokenizer, max_length=max_length)[:shown]
    heldout_pairs = load_pairs(str(heldout), tokenizer, max_length=max_length, field="heldout")
    train_rows, heldout_rows = _rows(train), _rows(heldout)
    train_before = score(model, tokenizer, train_pairs, train_rows)
    heldout_before = score(model, tokenizer, heldout_pairs, heldout_rows)
    started = time.perf_counter()
    result = train_run(config, sink or NullSink())
    seconds = time.perf_counter() - started
    if result.checkpoint is None:
        raise ValueError("the demo run wrote no checkpoint")
    if tuning == "lora":
        model, _ = load_for_inference(model_folder, adapter=result.checkpoint)
    else:
        model, _ = load_for_inference(result.checkpoint)
    return DemoResult(
        train_before=train_before,
        train_after=score(model, tokenizer, train_pairs, train_rows),
        heldout_before=heldout_before,
        heldout_after=score(model, tokenizer, heldout_pairs, heldout_rows),
        steps=result.step,
        seconds=seconds,
        checkpoint=result.checkpoint,
    )


def describe(result: DemoResult) -> list[str]:
    """The demo's report, line by line."""
    b, a = result.train_before, result.train_after
    lines = ["log-likelihood of each answer, before -> after:"]
    for i, prompt in enumerate(b.prompts):
        chosen = f"{float(b.chosen[i]):8.3f} -> {float(a.chosen[i]):8.3f}"
        rejected = f"{float(b.rejected[i]):8.3f} -> {float(a.rejected[i]):8.3f}"
        lines.append(
            f"  {prompt!r}\n      preferred {b.chosen_answers[i]!r}: {chosen}"
            f"    rejected {b.rejected_answers[i]!r}: {rejected}"
        )
    hb, ha = result.heldout_before, result.heldout_after
    lines.append(
        f"margin log p(preferred) - log p(rejected), mean: training pairs shown {b.margin:+.3f} -> "
        f"{a.margin:+.3f}; {len(hb.prompts)} held-out pairs {hb.margin:+.3f} -> {ha.margin:+.3f}"
    )
    lines.append(f"after {result.steps} DPO steps ({result.seconds:.0f} s); checkpoint: {result.checkpoint}")
    return lines
