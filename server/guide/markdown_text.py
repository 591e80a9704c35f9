"""Markdown text for the generated reference: escaped prose, code spans, tables and the rows of a
pydantic model's fields (name, type, default, constraints, description) read from its JSON schema.

Everything here is a pure function of its arguments, so the pages come out the same on every run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

# a code span of the docstrings' reStructuredText (``x``) or Markdown (`x`)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# characters that mean something to Markdown in running text (``<`` becomes an entity)
SPECIAL = re.compile(r"([\\*\[\]|])")
# an underscore that could open or close emphasis (one inside a word, as in max_length, cannot)
LOOSE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
NONE = "—"  # an empty cell


def code(text: str) -> str:
    """``text`` as a code span (longer fences when it holds backticks).

    Raises:
        ValueError: ``text`` holds a ``|``, which a table cell cannot show the same way on GitHub
            and in the service's renderer.
    """
    if "|" in text:
        raise ValueError(f"a code span in a table cannot hold '|': {text!r}")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def prose(text: str) -> str:
    """Running text on one line, Markdown's special characters escaped outside its code spans
    (kept as they are: a docstring's ``name`` reads as code)."""
    flat = " ".join(text.split())
    out, at = [], 0
    for match in CODE_SPAN.finditer(flat):
        out.append(_escaped(flat[at : match.start()]))
        out.append(match.group(0).replace("|", "\\|"))
        at = match.end()
    out.append(_escaped(flat[at:]))
    return "".join(out)


def _escaped(text: str) -> str:
    return LOOSE_UNDERSCORE.sub(r"\\_", SPECIAL.sub(r"\\\1", text)).replace("<", "&lt;")


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph, on one line ("" for none)."""
    if not doc:
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    """A Markdown table (cells already Markdown, one line each)."""
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell or NONE for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def number(value: Any) -> str:
    """A bound as a reader expects it: ``0.5``, ``1000000``, ``2147483647``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return json.dumps(value)


def literal(value: Any) -> str:
    """A value as JSON in a code span."""
    return code(json.dumps(value, ensure_ascii=False, sort_keys=True))


# -- a field's type and constraints, from its JSON schema ----------------------------------------

Links = Mapping[str, str]  # a $defs name -> where its model is described ("#hyper", "graders.md")


def ref_name(schema: Mapping[str, Any]) -> str | None:
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None


def type_text(schema: Mapping[str, Any], links: Links) -> str:
    """The type a field's schema describes, in words: ``integer``, ``string or null``,
    ``one of "lora", "full"``, ``list of string``, a link to a model's section."""
    name = ref_name(schema)
    if name is not None:
        target = links.get(name)
        return f"[{name}]({target})" if target else name
    if "const" in schema:
        return literal(schema["const"])
    if "enum" in schema and len(schema["enum"]) == 1:
        return literal(schema["enum"][0])
    if "enum" in schema:
        return "one of " + ", ".join(literal(v) for v in schema["enum"])
    branches = schema.get("anyOf") or schema.get("oneOf")
    if branches:
        return " or ".join(dict.fromkeys(type_text(b, links) for b in branches))
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        return f"list of {type_text(items, links)}" if items else "list"
    if kind == "object":
        values = schema.get("additionalProperties")
        if isinstance(values, Mapping) and values:
            return f"object of {type_text(values, links)}"
        return "object"
    if kind == "string" and schema.get("format") == "password":
        return "string (secret)"
    if kind == "string" and schema.get("format") == "path":
        return "path"
    return str(kind) if kind else "any"


BOUNDS = (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<"))


def constraints(schema: Mapping[str, Any]) -> list[str]:
    """The bounds a field's schema sets (those of an ``anyOf``'s branches included)."""
    out = [f"{sign} {number(schema[key])}" for key, sign in BOUNDS if key in schema]
    for low, high, what in (("minLength", "maxLength", "character"), ("minItems", "maxItems", "item")):
        if low in schema and high in schema:
            out.append(f"{schema[low]} to {schema[high]} {what}s")
        elif low in schema:
            out.append(f"at least {schema[low]} {what}{'s' if schema[low] != 1 else ''}")
        elif high in schema:
            out.append(f"at most {schema[high]} {what}{'s' if schema[high] != 1 else ''}")
    if "pattern" in schema:
        out.append(f"matches {code(schema['pattern'])}")
    for branch in schema.get("anyOf") or schema.get("oneOf") or ():
        out += [c for c in constraints(branch) if c not in out]
    return out


@dataclass(frozen=True)
class Row:
    """One field of a model, as the reference shows it (each part Markdown)."""

    name: str
    type: str
    default: str
    constraints: str
    description: str

    def cells(self) -> list[str]:
        return [self.name, self.type, self.default, self.constraints, self.description]


FIELD_HEADER = ("Field", "Type", "Default", "Constraints", "Description")


def default_text(info: Any, schema: Mapping[str, Any]) -> str:
    """A field's default: ``required``, its JSON value, or what its factory makes (a section's
    factory: the fields it sets, ``{}`` when every one keeps its own default)."""
    if "default" in schema:
        return literal(schema["default"])
    if info.default is not PydanticUndefined:
        return literal(_plain(info.default))
    factory: Callable[[], Any] | None = info.default_factory
    if factory is None:
        return "required"
    if info.default_factory_takes_validated_data:
        return "derived from the other fields"
    return literal(_plain(factory()))


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    return json.loads(json.dumps(value, default=str))


def field_rows(
    model: type[BaseModel],
    links: Links,
    *,
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    describe: Callable[[str, Mapping[str, Any]], str] | None = None,
) -> list[Row]:
    """The rows of ``model``'s fields, in its order, named as JSON names them (aliases).

    ``only``/``skip`` pick fields by JSON name; ``describe(name, schema)`` may give a field's
    description, as Markdown, where its schema has none (a section's model docstring)."""
    schema = model.model_json_schema()
    name = ref_name(schema)
    if name is not None:  # a model that holds itself (a multi grader): its schema is in $defs
        schema = schema["$defs"][name]
    properties: dict[str, Any] = schema.get("properties", {})
    infos = {(info.alias or name): info for name, info in model.model_fields.items()}
    wanted = set(only) if only is not None else set(properties)
    rows = []
    for key, prop in properties.items():
        if key not in wanted or key in skip:
            continue
        given = prop.get("description")
        text = prose(given) if given else (describe(key, prop) if describe else "")
        rows.append(
            Row(
                name=code(key),
                type=type_text(prop, links),
                default=default_text(infos[key], prop),
                constraints=", ".join(constraints(prop)),
                description=text,
            )
        )
    return rows


def fields_table(rows: Iterable[Row]) -> str:
    return table(FIELD_HEADER, (row.cells() for row in rows))
