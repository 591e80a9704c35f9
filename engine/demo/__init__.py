"""The demo: a task the small base model gets wrong, and learns in a few minutes on a CPU.

Each row lists a small inventory and asks for the count of one item; the answer is the bare
number. The instruct base model answers in sentences (or miscounts), so its exact-match accuracy
is low; a short LoRA fine-tune teaches it to find the item and answer with the number alone.
The DPO demo (``engine.demo.dpo``) asks the same questions with the right count preferred over
another item's count; the GRPO demo (``engine.demo.grpo``) asks them as prompts alone, with the
count as the reference answer its grader checks the sampled answers against. The committed files
under ``data/`` are the output of ``make_rows``, ``make_preference_rows`` and ``make_prompt_rows``
(tests check that).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "DATA",
    "HELDOUT",
    "ITEMS",
    "PREFERENCE_HELDOUT",
    "PREFERENCE_TRAIN",
    "PROMPTS_HELDOUT",
    "PROMPTS_TRAIN",
    "PROMPT_SUFFIX",
    "TRAIN",
    "make_preference_rows",
    "make_prompt_rows",
    "make_rows",
    "regenerate",
    "write",
]

DATA = Path(__file__).resolve().parent / "data"
TRAIN = DATA / "inventory_train.jsonl"
HELDOUT = DATA / "inventory_heldout.jsonl"
# preference rows for the DPO demo: the right count preferred over another item's count
PREFERENCE_TRAIN = DATA / "inventory_preference_train.jsonl"
PREFERENCE_HELDOUT = DATA / "inventory_preference_heldout.jsonl"
# prompt rows for the GRPO demo: the question, and the count as ``reference_answer``
PROMPTS_TRAIN = DATA / "inventory_prompts_train.jsonl"
PROMPTS_HELDOUT = DATA / "inventory_prompts_heldout.jsonl"
ITEMS = ["apples", "pears", "plums", "lemons", "cherries", "melons", "grapes", "peaches", "figs", "limes"]


def make_rows(n: int, seed: int) -> list[dict[str, object]]:
    """``n`` chat rows: an inventory of 3–4 items with counts 1–9, a question about one of them."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        items = rng.sample(ITEMS, rng.randint(3, 4))
        counts = [rng.randint(1, 9) for _ in items]
        asked = rng.randrange(len(items))
        listing = ", ".join(f"{c} {item}" for item, c in zip(items, counts, strict=True))
        question = f"Inventory: {listing}. How many {items[asked]}?"
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": str(counts[asked])},
                ]
            }
        )
    return rows


def make_preference_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` preference rows: an inventory question (3–4 items, distinct counts 1–9), the right
    count as the preferred answer and the count of another item listed as the rejected one."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for _ in range(n):
        items = rng.sample(ITEMS, rng.randint(3, 4))
        counts = rng.sample(range(1, 10), len(items))
        asked = rng.randrange(len(items))
        other = rng.choice([i for i in range(len(items)) if i != asked])
        listing = ", ".join(f"{c} {item}" for item, c in zip(items, counts, strict=True))
        rows.append(
            {
                "prompt": f"Inventory: {listing}. How many {items[asked]}?",
                "chosen": str(counts[asked]),
                "rejected": str(counts[other]),
            }
        )
    return rows


PROMPT_SUFFIX = " Answer with the number only."


def make_prompt_rows(n: int, seed: int) -> list[dict[str, object]]:
    """``n`` prompt rows: ``make_rows``' questions as a user turn asking for the bare number, the
    count as ``reference_answer``."""
    rows: list[dict[str, object]] = []
    for row in make_rows(n, seed):
        messages = row["messages"]
        assert isinstance(messages, list)
        question = {"role": "user", "content": messages[0]["content"] + PROMPT_SUFFIX}
        rows.append({"messages": [question], "reference_answer": messages[1]["content"]})
    return rows


def write(path: Path, rows: Sequence[Mapping[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def regenerate() -> None:
    """Write the committed demo files (train: 400 rows, held-out: 40 rows; preference: 48 and
    16 rows; prompts: 64 and 16 rows)."""
    write(TRAIN, make_rows(400, seed=1))
    write(HELDOUT, make_rows(40, seed=2))
    write(PREFERENCE_TRAIN, make_preference_rows(48, seed=3))
    write(PREFERENCE_HELDOUT, make_preference_rows(16, seed=4))
    write(PROMPTS_TRAIN, make_prompt_rows(64, seed=5))
    write(PROMPTS_HELDOUT, make_prompt_rows(16, seed=6))


if __name__ == "__main__":
    regenerate()
