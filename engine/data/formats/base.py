"""The data-format registry: one ``DataFormat`` per row shape, each joined by its own module.

A format says what a row of it looks like (``detect``), checks a row and makes the engine's
``Example`` of it (``example``), encodes that example into the token sequences a run trains on
(``encode``, ``sequences``), and shows it on the datasets page (``preview``). Its ``family`` is
the ``data_format`` of the training methods that read it (``engine.methods``).

Formats are kept in the order they registered (the order of listings and error messages);
detection asks them by ``detect_order``, the lowest first, so that a shape whose keys overlap
another's (a prompt row's ``messages``) is asked before it.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field

from engine.data.rows import Example
from engine.data.sequences import Encoded, EncodedRow, encode, sequence_view

Family = Literal["supervised", "preference", "unpaired", "prompts"]
FAMILIES: tuple[Family, ...] = ("supervised", "preference", "unpaired", "prompts")

REGISTRY: dict[str, DataFormat] = {}  # by name, in the order of registration
NAME = re.compile(r"[a-z][a-z0-9_]*")


class DataFormat(ABC):
    """One row shape of dataset files.

    Attributes:
        name: the ``data.format`` value and the dataset's recorded format, e.g. ``"chat"``.
        title: a short label for messages and listings, e.g. ``"prompt/completion"``.
        family: the ``data_format`` of the methods that train on it.
        description: the row's fields in a line, for the upload form and listings.
        measures: what the token statistics of a row count, when not the row itself.
        detect_order: detection asks the formats lowest first.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    family: ClassVar[Family]
    description: ClassVar[str]
    measures: ClassVar[str] = ""
    detect_order: ClassVar[int] = 100

    @abstractmethod
    def detect(self, record: dict[str, Any]) -> bool:
        """Whether a record's keys announce this shape."""

    @abstractmethod
    def example(self, line: int, record: dict[str, Any]) -> Example:
        """The row checked and normalised.

        Raises:
            ValueError: what is wrong, naming the field (the caller adds the line).
        """

    def encode(self, example: Example, tokenizer: Any, max_length: int) -> EncodedRow:
        """What a run trains on for this row, each sequence truncated to ``max_length``.

        Raises:
            ValueError: a chat template that renders conversation prefixes differently.
        """
        return encode(example, tokenizer, max_length)

    def sequences(self, encoded: EncodedRow) -> list[tuple[str, Encoded]]:
        """The sequences of an encoded row, each with how an error names it (``""``: the row)."""
        if not isinstance(encoded, Encoded):
            raise TypeError(f"format {self.name!r} encodes one sequence a row, got {type(encoded).__name__}")
        return [("", encoded)]

    def trains_on_rows(self) -> bool:
        """Whether every sequence must hold a trained token (not so for a prompt, whose answers
        are sampled in training)."""
        return True

    def preview(self, example: Example, tokenizer: Any, max_length: int) -> dict[str, Any]:
        """The row for the datasets page: its tokens, each marked trained or not, and whatever
        else the format shows (a pair's two answers, a prompt's grader fields)."""
        encoded = self.encode(example, tokenizer, max_length)
        if not isinstance(encoded, Encoded):
            raise TypeError(f"format {self.name!r} must preview its own row shape")
        return sequence_view(tokenizer, encoded)

    def listing(self) -> dict[str, Any]:
        """The format as JSON, for the service's listing."""
        return {
            "name": self.name,
            "title": self.title,
            "family": self.family,
            "description": self.description,
            "measures": self.measures,
        }


def register(fmt: DataFormat) -> DataFormat:
    """Add a format to the registry (a format's module calls it once, at import).

    Raises:
        ValueError: a name taken, or not lower-case letters, digits and underscores; a family not
            one of ``FAMILIES``.
    """
    if not NAME.fullmatch(fmt.name) or fmt.name == "auto":
        raise ValueError(f"format name {fmt.name!r}: use lower-case letters, digits and '_' (not 'auto')")
    if fmt.name in REGISTRY:
        raise ValueError(f"format {fmt.name!r} is registered already")
    if fmt.family not in FAMILIES:
        raise ValueError(f"format {fmt.name!r}: unknown family {fmt.family!r} (use {', '.join(FAMILIES)})")
    REGISTRY[fmt.name] = fmt
    return fmt


def format_names() -> tuple[str, ...]:
    """Every format's name, in registry order (``data.format`` also takes ``"auto"``)."""
    return tuple(REGISTRY)


def get_format(name: str) -> DataFormat:
    """The format of this name.

    Raises:
        ValueError: no such format, naming those there are.
    """
    found = REGISTRY.get(name)
    if found is None:
        raise ValueError(f"unknown format {name!r}; use auto or one of {', '.join(REGISTRY)}")
    return found


def detect_format(record: dict[str, Any]) -> str | None:
    """The name of the format a record's keys announce, or None."""
    for fmt in sorted(REGISTRY.values(), key=lambda f: f.detect_order):
        if fmt.detect(record):
            return fmt.name
    return None


def family_of(name: str) -> Family:
    """The ``data_format`` family a format serves, e.g. ``"supervised"`` for ``"chat"``.

    Raises:
        ValueError: no such format.
    """
    return get_format(name).family


def formats_of(family: Family) -> list[DataFormat]:
    """The formats of one family, in registry order."""
    return [f for f in REGISTRY.values() if f.family == family]


def titles(family: Family) -> str:
    """The titles of a family's formats as a phrase: ``"chat, instruction, prompt/completion or text"``."""
    names = [f.title for f in formats_of(family)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def formats_listing() -> list[dict[str, Any]]:
    """Every format as JSON, in registry order."""
    return [f.listing() for f in REGISTRY.values()]


def choose_format(value: str) -> str:
    """``value`` if it is ``"auto"`` or a format's name.

    Raises:
        ValueError: naming the formats there are.
    """
    if value != "auto":
        get_format(value)
    return value


def _choices_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = ["auto", *REGISTRY]  # read when the schema is made: every format registered


# a ``data.format`` field: "auto" or a registered format's name, listed as such in JSON schemas
FormatChoice = Annotated[str, AfterValidator(choose_format), Field(json_schema_extra=_choices_schema)]
