"""The GRPO demo: a verifiable task, graded answers, and the mean reward before and after.

The prompts are the inventory questions (``engine.demo``), asking for the number only, each with
its count as ``reference_answer``. The grader (``GRADER``) gives 0.6 to an answer that is the bare
count, 0.2 to one that starts with a number, and up to 0.2 more when that answer is also short
(all of it up to 2 characters, none from 22). The instruct base model answers in lists and
sentences ("1. 2 limes", "To solve this problem, ..."), so it scores little; GRPO steps on groups
of sampled answers teach it to answer with a number, and the right one scores most. The mean
reward of greedy answers to held-out prompts is measured before and after, with the same grader.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import demo
from engine.metrics import NullSink, Sink
from engine.training.checkpoint_layout import CheckpointKind

GRADER: dict[str, Any] = {
    "type": "multi",
    "name": "count",
    "graders": {
        "exact": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}",
            "operation": "eq",
        },
        "number_first": {
            "type": "regex",
            "name": "number_first",
            "input": "{{sample.output_text}}",
            "pattern": "^\\s*\\d",
        },
        "short": {
            "type": "length",
            "name": "short",
            "input": "{{sample.output_text}}",
            "max_length": 2,
            "falloff": 20,
        },
    },
    "calculate_output": "0.6 * exact + 0.2 * number_first + 0.2 * number_first * short",
}


@dataclass
class Scored:
    """Greedy answers to some prompts, their rewards and their mean."""

    prompts: list[str]
    answers: list[str]
    rewards: list[float]

    @property
    def mean(self) -> float:
        return sum(self.rewards) / max(len(self.rewards), 1)


@dataclass
class DemoResult:
    """The held-out prompts' rewards before and after, and the training reward step by step."""

    before: Scored
    after: Scored
    step_rewards: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    checkpoint: Path | None = None


def demo_config(
    model: str,
    *,
    steps: int,
    workers: int,
    output_dir: str | Path,
    train: Path = demo.PROMPTS_TRAIN,
    learning_rate: float = 2e-3,
    group_size: int = 6,
) -> dict[str, Any]:
    """The demo run's ``TrainConfig`` mapping: ``steps`` GRPO steps of 4 prompts x ``group_size``."""
    return {
        "model": {"path": model},
        "data": {"train": str(train), "max_length": 96},
        "method": {
            "objective": "grpo",
            "tuning": "lora",
            "lora_r": 16,
            "lora_alpha": 32,
            "grader": GRADER,
            "group_size": group_size,
            "max_completion_tokens": 8,
            "temperature": 1.0,
            "beta": 0.0,
            "loss_type": "dapo",
        },
        "hyper": {
            "max_steps": steps,
            "batch_size": 4,
            "learning_rate": learning_rate,
            "schedule": "constant",
        },
        "engine": {"devices": ["cpu"] * workers, "num_microbatches": 2},
        "checkpoint": {"every_steps": steps, "keep_last": 1},
        "output_dir": str(output_dir),
    }


def score(model: Any, tokenizer: Any, path: Path, grader: Any) -> Scored:
    """Greedy answers to the prompts of ``path`` and the grader's reward of each."""
    from engine.data.prompts import load_prompts
    from engine.methods.rollouts import Sampling, sample

    items = load_prompts(str(path), tokenizer, max_prompt_tokens=84, field="prompts")
    model.eval()
    rollout = sample(model, tokenizer, items, Sampling(1, 8), seed=0, greedy=True)
    result = grader.grade_batch(rollout.texts, rollout.row_items())
    questions = [it.text for it in items]
    return Scored(questions, rollout.texts, [float(r) for r in result.rewards])


class _Rewards(NullSink):
    """Keeps each step's ``reward/mean`` and passes everything on."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.rewards: list[float] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "reward/mean" in metrics:
            self.rewards.append(float(metrics["reward/mean"]))
        self.inner.log(metrics, step)

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.inner.event(kind, message, data)

    def checkpoint_saved(self, step: int, path: Path, kind: CheckpointKind, bytes: int) -> None:
        self.inner.checkpoint_saved(step, path, kind, bytes)


def run_demo(
    model_folder: Path,
    *,
    steps: int,
    workers: int,
    output_dir: str | Path,
    train: Path = demo.PROMPTS_TRAIN,
    heldout: Path = demo.PROMPTS_HELDOUT,
    learning_rate: float = 2e-3,
    group_size: int = 6,
    sink: Sink | None = None,
) -> DemoResult:
    """Score the held-out prompts, train ``steps`` GRPO steps, score them again.

    Raises:
        ValueError: the run wrote no checkpoint, or a bad configuration (``ConfigError``).
    """
    from engine.config import TrainConfig
    from engine.graders import validate_grader
    from engine.inference.generate import load_for_inference
    from engine.training.run import train as train_run

    config = TrainConfig.parse(
        demo_config(
            str(model_folder),
            steps=steps,
            workers=workers,
            output_dir=output_dir,
            train=train,
            learning_rate=learning_rate,
            group_size=group_size,
        )
    )
    grader = validate_grader(GRADER)
    try:
        model, tokenizer = load_for_inference(model_folder)
        before = score(model, tokenizer, heldout, grader)
        del model
        rewards = _Rewards(sink or NullSink())
        started = time.perf_counter()
        result = train_run(config, rewards)
        seconds = time.perf_counter() - started
        if result.checkpoint is None:
            raise ValueError("the demo run wrote no checkpoint")
        model, tokenizer = load_for_inference(model_folder, adapter=result.checkpoint)
        after = score(model, tokenizer, heldout, grader)
    finally:
        grader.close()
    return DemoResult(before, after, rewards.rewards, result.step, seconds, result.checkpoint)


def describe(result: DemoResult) -> list[str]:
    """The demo's report, line by line."""
    lines = ["held-out prompts, greedy answer before -> after (reward):"]
    for i, prompt in enumerate(result.before.prompts[:6]):
        question = prompt.split("user\n", 1)[-1].split("<|im_end|>", 1)[0].strip()
        lines.append(
            f"  {question!r}: {result.before.answers[i]!r} ({result.before.rewards[i]:.2f}) -> "
            f"{result.after.answers[i]!r} ({result.after.rewards[i]:.2f})"
        )
    r = result.step_rewards
    if r:
        k = max(1, min(3, len(r) // 3))
        first, last = sum(r[:k]) / k, sum(r[-k:]) / k
        lines.append(
            f"training reward (mean of sampled answers): first {k} steps {first:.3f} -> last {k} {last:.3f}"
        )
    lines.append(
        f"held-out mean reward: {result.before.mean:.3f} -> {result.after.mean:.3f} after {result.steps} "
        f"GRPO steps ({result.seconds:.0f} s); checkpoint: {result.checkpoint}"
    )
    return lines
