"""Preference rows (for DPO): a prompt, the answer preferred and the answer rejected.

Shapes, told apart by their keys:
- OpenAI: ``{"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", "content": str}],
  "non_preferred_output": [...]}``; ``prompt`` (a string) may stand for ``input``, and any other
  key of ``input`` (``tools``, ...) is ignored;
- explicit prompt (TRL): ``{"prompt": str, "chosen": str, "rejected": str}``, or ``prompt`` as a
  list of messages and each answer a list holding one assistant message;
- implicit prompt (TRL): ``{"chosen": [conversation], "rejected": [conversation]}``, two whole
  conversations that share every message but the last, the assistant's answer.

A prompt given as messages follows the chat rules (an optional system turn, then user and
assistant alternating) and ends with a user turn; a prompt string is one user turn. Each answer
is a single assistant turn. In CSV files every cell is a string: ``prompt``/``chosen``/``rejected``.

A row trains as two sequences (``EncodedPair``), the prompt with each answer, the loss on the
answer alone.
"""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, answer_text, conversation, prompt_turns
from engine.data.sequences import Encoded, EncodedPair, EncodedRow, encode_pair, pair_view

ANSWER_KEYS = (("chosen", "rejected"), ("preferred_output", "non_preferred_output"))
PREFERENCE_KEYS = tuple(key for pair in ANSWER_KEYS for key in pair)


class Preference(DataFormat):
    name = "preference"
    title = "preference"
    family = "preference"
    description = (
        "preference pairs (prompt with chosen/rejected, or input with preferred_output/non_preferred_output)"
    )
    measures = "both answers of each pair"
    detect_order = 0  # its rows may hold any other format's keys besides its own

    def detect(self, record: dict[str, Any]) -> bool:
        return any(key in record for key in PREFERENCE_KEYS)

    def example(self, line: int, record: dict[str, Any]) -> Example:
        return preference_example(line, record)

    def encode(self, example: Example, tokenizer: Any, max_length: int) -> EncodedPair:
        return encode_pair(example, tokenizer, max_length)

    def sequences(self, encoded: EncodedRow) -> list[tuple[str, Encoded]]:
        if not isinstance(encoded, EncodedPair):
            raise TypeError(f"a preference row encodes as a pair, got {type(encoded).__name__}")
        return [(" of the preferred answer", encoded.chosen), (" of the rejected answer", encoded.rejected)]

    def preview(self, example: Example, tokenizer: Any, max_length: int) -> dict[str, Any]:
        return pair_view(tokenizer, self.encode(example, tokenizer, max_length))


def preference_example(line: int, record: dict[str, Any]) -> Example:
    """A preference row as an ``Example``: ``messages`` is the prompt and the preferred answer,
    ``rejected`` the other answer.

    Raises:
        ValueError: what is wrong with the row, naming the field.
    """
    good, bad = _answer_keys(record)
    if "input" in record or "prompt" in record:
        prompt = _prompt(record)
        chosen, rejected = answer_text(record, good), answer_text(record, bad)
    else:
        prompt, chosen, rejected = _implicit(record, good, bad)
    if chosen.strip() == rejected.strip():
        raise ValueError(f"'{good}' and '{bad}' are the same answer; a pair needs two different ones")
    return Example(line, messages=[*prompt, {"role": "assistant", "content": chosen}], rejected=rejected)


def _answer_keys(record: dict[str, Any]) -> tuple[str, str]:
    found = [keys for keys in ANSWER_KEYS if any(k in record for k in keys)]
    if len(found) > 1:
        raise ValueError(
            "give the answers as 'chosen'/'rejected' or as 'preferred_output'/'non_preferred_output', "
            "not both"
        )
    if not found:
        raise ValueError(
            "missing fields 'chosen' and 'rejected' (or 'preferred_output' and 'non_preferred_output')"
        )
    return found[0]


def _prompt(record: dict[str, Any]) -> list[dict[str, str]]:
    if "input" in record and "prompt" in record:
        raise ValueError("give the prompt as 'input' or as 'prompt', not both")
    if "input" in record:
        value = record["input"]
        if not isinstance(value, dict):
            raise ValueError(f"field 'input' must be an object with 'messages', got {type(value).__name__}")
        return conversation(value.get("messages"), "input.messages", end="user")
    return prompt_turns(record)


def _implicit(record: dict[str, Any], good: str, bad: str) -> tuple[list[dict[str, str]], str, str]:
    """The shared prompt and the two answers of two whole conversations."""
    whole = []
    for key in (good, bad):
        value = record.get(key)
        if isinstance(value, str):
            raise ValueError(
                f"without a 'prompt', field '{key}' must be a whole conversation (a list of messages "
                "ending with the answer), got a string"
            )
        whole.append(conversation(value, key))
    chosen, rejected = whole
    for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1], strict=False)):
        if a != b:
            raise ValueError(
                f"'{good}' and '{bad}' differ at message {i}, before their last turn; without a 'prompt' "
                "they must share every message but the answer"
            )
    if len(chosen) != len(rejected):
        raise ValueError(
            f"'{good}' has {len(chosen)} messages and '{bad}' {len(rejected)}; without a 'prompt' they "
            "must share every message but the answer"
        )
    return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"]


PREFERENCE = register(Preference())
