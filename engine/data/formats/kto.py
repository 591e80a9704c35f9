"""Unpaired preference rows (for KTO): a prompt, one completion, and whether it is desirable.

Shapes, as TRL's KTOTrainer and LLaMA-Factory's ``kto`` read them:
- standard: ``{"prompt": str, "completion": str, "label": true|false}``;
- conversational: ``{"prompt": [messages ending with a user turn], "completion": [one assistant
  message], "label": true|false}``.

``label`` is a JSON boolean: ``true``, the completion is desirable; ``false``, undesirable. A
string such as ``"true"`` is refused, so a CSV file (every cell a string) cannot hold these rows:
use JSONL or Parquet. A prompt string is one user turn; a prompt of messages follows the chat
rules. A row encodes as one side of a preference pair does: the prompt and the completion through
the chat template, the loss on the completion alone (``EncodedUnpaired``: its prompt ids,
completion ids and label).
"""

from __future__ import annotations

from typing import Any

from engine.data.formats.base import DataFormat, register
from engine.data.rows import Example, answer_text, prompt_turns
from engine.data.sequences import Encoded, EncodedRow, EncodedUnpaired, encode_unpaired, sequence_view


class Kto(DataFormat):
    name = "kto"
    title = "KTO"
    family = "unpaired"
    description = "unpaired preference rows (prompt, completion and a boolean label: true = desirable)"
    detect_order = 5  # before prompt/completion, whose keys its rows hold too

    def detect(self, record: dict[str, Any]) -> bool:
        return "label" in record and "prompt" in record and "completion" in record

    def example(self, line: int, record: dict[str, Any]) -> Example:
        """The prompt's turns and the completion as the last, assistant, turn; its label.

        Raises:
            ValueError: naming the field at fault (a label that is no JSON boolean among them).
        """
        label = record.get("label")
        if label is None:
            raise ValueError("missing field 'label' (true: the completion is desirable, false: undesirable)")
        if not isinstance(label, bool):
            raise ValueError(
                f"field 'label' must be a JSON boolean, true (desirable) or false (undesirable), "
                f"got {type(label).__name__} {label!r:.40}"
            )
        prompt = prompt_turns(record)
        completion = answer_text(record, "completion")
        return Example(line, messages=[*prompt, {"role": "assistant", "content": completion}], label=label)

    def encode(self, example: Example, tokenizer: Any, max_length: int) -> EncodedRow:
        return encode_unpaired(example, tokenizer, max_length)

    def sequences(self, encoded: EncodedRow) -> list[tuple[str, Encoded]]:
        if not isinstance(encoded, EncodedUnpaired):
            raise TypeError(f"a KTO row encodes as an unpaired row, got {type(encoded).__name__}")
        return [(" of the completion", encoded.sequence)]

    def preview(self, example: Example, tokenizer: Any, max_length: int) -> dict[str, Any]:
        """The prompt and completion, the completion's tokens trained, and the row's label."""
        encoded = encode_unpaired(example, tokenizer, max_length)
        return {**sequence_view(tokenizer, encoded.sequence), "label": encoded.label}


KTO = register(Kto())
