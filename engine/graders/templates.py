"""Template references, as OpenAI's graders write them: ``{{sample.output_text}}``,
``{{item.reference_answer}}``, ``{{item.<any field>}}`` (dotted into nested objects, a number
indexing a list: ``{{item.answers.0}}``), inside any text.

A template is checked once (``Template.parse``: only ``sample`` and ``item`` can be named, and of
the sample only ``output_text``, ``output_json`` and ``choices``; ``TemplateError`` says why not)
and rendered per sample: a
string is inserted as it is, null as nothing, anything else as JSON. A field the item lacks fails
that sample (``GradeFailure`` of kind ``"template"``), it does not render as empty.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.graders.base import GradeFailure

SAMPLE_FIELDS = ("output_text", "output_json", "choices")
_REFERENCE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_SEGMENT = re.compile(r"^[^\s.{}]+$")


class TemplateError(ValueError):
    """A template that is not valid: a reference to neither the sample nor the item, or one not
    closed; the message says which."""


@dataclass(frozen=True)
class Reference:
    """One ``{{root.a.b}}``: the root (``sample`` or ``item``) and the path below it."""

    root: str
    path: tuple[str, ...]

    def __str__(self) -> str:
        return ".".join((self.root, *self.path))

    def lookup(self, sample: Mapping[str, Any], item: Mapping[str, Any]) -> Any:
        value: Any = sample if self.root == "sample" else item
        walked = self.root
        for key in self.path:
            if isinstance(value, Mapping) and key in value:
                value = value[key]
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                what = "the sample" if walked == "sample" else walked
                raise GradeFailure(f"{{{{{self}}}}}: {what} has no field {key!r}", "template")
            walked = f"{walked}.{key}"
        return value


@dataclass(frozen=True)
class Template:
    """A text with ``{{...}}`` references: literal parts and references, alternating."""

    source: str
    parts: tuple[str | Reference, ...]

    @classmethod
    def parse(cls, source: str) -> Template:
        """Check ``source``'s references.

        Raises:
            TemplateError: a reference is not valid.
        """
        parts: list[str | Reference] = []
        position = 0
        for match in _REFERENCE.finditer(source):
            parts.append(source[position : match.start()])
            parts.append(_reference(match.group(1).strip()))
            position = match.end()
        rest = source[position:]
        if "{{" in rest:
            raise TemplateError("a '{{' is not closed by '}}'")
        parts.append(rest)
        return cls(source, tuple(p for p in parts if p != ""))

    @property
    def references(self) -> tuple[Reference, ...]:
        return tuple(p for p in self.parts if isinstance(p, Reference))

    def render(self, sample: Mapping[str, Any], item: Mapping[str, Any]) -> str:
        """The text for one sample and its item."""
        if len(self.parts) == 1 and isinstance(self.parts[0], Reference):
            return as_text(self.parts[0].lookup(sample, item))
        out = []
        for part in self.parts:
            out.append(part if isinstance(part, str) else as_text(part.lookup(sample, item)))
        return "".join(out)


def as_text(value: Any) -> str:
    """A value as a template inserts it: a string as is, null as nothing, the rest as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, default=str)


def _reference(inside: str) -> Reference:
    root, *path = inside.split(".") if inside else [""]
    if root not in ("sample", "item"):
        raise TemplateError(
            f"{{{{{inside}}}}} names neither the sample nor the item; write "
            "{{sample.output_text}}, {{sample.output_json.<field>}} or {{item.<field>}}"
        )
    for segment in path:
        if not _SEGMENT.match(segment):
            raise TemplateError(f"{{{{{inside}}}}} is not a dotted field name")
    if root == "sample" and (not path or path[0] not in SAMPLE_FIELDS):
        fields = ", ".join(f"sample.{f}" for f in SAMPLE_FIELDS)
        raise TemplateError(f"{{{{{inside}}}}}: a sample has {fields}")
    return Reference(root, tuple(path))
