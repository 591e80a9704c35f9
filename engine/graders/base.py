"""What every grader shares: the result of a batch, the ``Grader`` base class, the sample a model
answer becomes, and ``Fields``, the reader that checks a grader's JSON object field by field and
names the field at fault (``grader.graders.b.operation``) in its ``ConfigError``."""

from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from engine.errors import ConfigError

# what went wrong with one sample, for a program: the service maps each to OpenAI's error flags
ErrorKind = Literal["runtime", "timeout", "crashed", "formula", "template", "other"]
# the largest float32: a reward becomes a float32 tensor, where anything beyond is inf
FLOAT32_MAX = 3.4028234663852886e38


def unscorable(value: float) -> str | None:
    """Why ``value`` cannot be a score (not finite, or beyond float32's range), or None."""
    if not math.isfinite(value):
        return f"the score is {value}, not a finite number"
    if abs(value) > FLOAT32_MAX:
        return f"the score {value:g} is beyond float32's range (+-{FLOAT32_MAX:.4g}): it would be inf"
    return None


MAX_NAME = 256
MAX_TEXT = 100_000  # characters of a template, a pattern or a Python grader's source
_NAME = re.compile(r"^[^\x00-\x1f\x7f]+$")
_MISSING: Any = object()


@dataclass
class GradeResult:
    """The grades of a batch of samples, one entry per sample in each list.

    Attributes:
        rewards: the grader's score of each sample; 0.0 where it failed.
        sub_rewards: each named sub-grader's scores (a ``multi`` grader's, keyed by their names,
            a nested ``multi``'s as ``outer.inner``); a single grader's under its own name.
        errors: why the grader failed on each sample (it then scored 0), or None.
        error_kinds: what kind of failure each error is (``ErrorKind``), or None.
    """

    rewards: list[float]
    sub_rewards: dict[str, list[float]]
    errors: list[str | None]
    error_kinds: list[ErrorKind | None] = field(default_factory=list)


class GradeFailure(Exception):
    """One sample could not be graded: it scores 0 and ``str(self)`` is reported beside it."""

    def __init__(self, message: str, kind: ErrorKind = "other") -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


@dataclass
class Scores:
    """A grader's outcome on a batch (internal): the scores, the failures, the sub-graders'."""

    values: list[float]
    errors: list[str | None]
    kinds: list[ErrorKind | None]
    sub: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def failed(cls, count: int, message: str, kind: ErrorKind) -> Scores:
        """Every sample of the batch failed the same way."""
        return cls([0.0] * count, [message] * count, [kind] * count)


def make_sample(text: str) -> dict[str, Any]:
    """The ``sample`` a grader sees for a model's answer, in OpenAI's shape: ``output_text``,
    ``output_json`` (the answer parsed as JSON, or None when it is not JSON) and ``choices`` (one
    assistant message)."""
    return {
        "output_text": text,
        "output_json": parse_json(text),
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
    }


def parse_json(text: str) -> Any:
    """``text`` parsed as JSON, or None when it is not JSON (or too deep or too large a number)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def short(message: str, limit: int = 1000) -> str:
    """A message cut to ``limit`` characters, anything not Unicode text (a lone surrogate a
    Python grader raised with) written as an escape."""
    if not message.isascii():
        message = message.encode("utf-8", "backslashreplace").decode()
    return message if len(message) <= limit else message[: limit - 3] + "..."


class Grader(ABC):
    """A grader: scores model answers against dataset rows.

    ``grade_batch`` never raises for a sample: a sample the grader cannot grade scores 0 and its
    error is reported in ``GradeResult.errors``. ``close()`` stops any child process (a ``python``
    grader's); a grader is also a context manager that closes itself.

    Attributes:
        type: the grader's type (``"string_check"``, ``"multi"``, ...).
        name: its name (given, or its type).
    """

    type: ClassVar[str]

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """The grader as JSON, with every default filled in (what ``validate_grader`` accepts)."""

    @abstractmethod
    def scores(self, samples: list[dict[str, Any]], items: Sequence[Mapping[str, Any]]) -> Scores:
        """Grade ``samples`` (``make_sample`` dicts) against ``items``, one pair each (internal:
        ``grade_batch`` is the entry point)."""

    def grade_batch(self, samples: list[str], items: list[dict[str, Any]]) -> GradeResult:
        """Grade each model answer in ``samples`` against the dataset row at the same place in
        ``items``.

        Raises:
            ValueError: the two lists differ in length.
        """
        if len(samples) != len(items):
            raise ValueError(f"{len(samples)} samples but {len(items)} items: give one item per sample")
        try:
            made = [make_sample(text) for text in samples]
            outcome = self.scores(made, items)
        except Exception as exc:  # a fault of the grader itself: every sample fails, nothing raises
            outcome = Scores.failed(len(samples), short(f"{type(exc).__name__}: {exc}"), "other")
        values, errors, kinds = list(outcome.values), list(outcome.errors), list(outcome.kinds)
        for i, value in enumerate(values):  # whatever the grader, a reward is a float32
            problem = unscorable(value) if errors[i] is None else None
            if problem is not None:
                values[i], errors[i], kinds[i] = 0.0, problem, "other"
        sub = outcome.sub or {self.name: list(outcome.values)}
        return GradeResult(values, sub, errors, kinds)

    def grade(self, sample: str, item: dict[str, Any]) -> tuple[float, str | None]:
        """One answer's score and error (None when it was graded)."""
        result = self.grade_batch([sample], [item])
        return result.rewards[0], result.errors[0]

    def close(self) -> None:  # noqa: B027 - most graders hold nothing to release
        """Stop what the grader runs besides this process (nothing, but for a ``python`` grader)."""

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalGrader(Grader):
    """A grader that scores one sample at a time in this process."""

    @abstractmethod
    def score(self, sample: dict[str, Any], item: Mapping[str, Any]) -> float:
        """One sample's score; raises ``GradeFailure`` when it cannot be graded."""

    def scores(self, samples: list[dict[str, Any]], items: Sequence[Mapping[str, Any]]) -> Scores:
        out = Scores([], [], [])
        for sample, item in zip(samples, items, strict=True):
            value, error = 0.0, None
            kind: ErrorKind | None = None
            try:
                value = float(self.score(sample, item))
                error = unscorable(value)
                if error is not None:
                    value, kind = 0.0, "other"
            except GradeFailure as exc:
                error, kind = short(str(exc)), exc.kind
            except Exception as exc:
                error, kind = short(f"{type(exc).__name__}: {exc}"), "other"
            out.values.append(value)
            out.errors.append(error)
            out.kinds.append(kind)
        return out


class Fields:
    """A grader's JSON object read field by field; every error names the field's dotted path.

    Args:
        spec: the object given.
        path: its own path, e.g. ``"grader"`` or ``"grader.graders.b"``.
    """

    def __init__(self, spec: Any, path: str) -> None:
        if not isinstance(spec, Mapping):
            raise ConfigError(path, f"{path}: must be an object, got {_kind(spec)}", value=spec)
        self.spec, self.path = spec, path
        self.read: set[str] = set()

    def at(self, key: str) -> str:
        """The dotted path of a field."""
        return f"{self.path}.{key}"

    def fail(self, key: str, message: str, value: Any = None) -> ConfigError:
        """The error of a field: ``<path>.<key>: <message>``."""
        return ConfigError(self.at(key), f"{self.at(key)}: {message}", value=value)

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self.read.add(key)
        if key in self.spec and self.spec[key] is not None:
            return self.spec[key]
        if default is _MISSING:
            raise self.fail(key, "is required")
        return default

    def text(self, key: str, default: Any = _MISSING, *, max_length: int = MAX_TEXT) -> Any:
        """A string field (``default`` when it is left out or null; required without one)."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {_kind(value)}", value)
        if len(value) > max_length:
            raise self.fail(key, f"must be at most {max_length} characters, got {len(value)}", value)
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                raise self.fail(key, "must be Unicode text (it holds a lone surrogate)") from exc
        return value

    def name(self, default: str) -> str:
        """The ``name`` field: one line of up to 256 characters, ``default`` when left out."""
        value: str = self.text("name", default, max_length=MAX_NAME)
        if not _NAME.match(value):
            raise self.fail("name", "must be one line of text, not empty, without control characters")
        return value

    def choice(self, key: str, choices: Sequence[str], default: Any = _MISSING) -> Any:
        """A string field that must be one of ``choices``."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, str) or value not in choices:
            got = repr(value) if isinstance(value, str) else _kind(value)
            raise self.fail(key, f"must be one of {', '.join(choices)} (got {got})", value)
        return value

    def number(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        integer: bool = False,
    ) -> Any:
        """A number field within ``[minimum, maximum]`` (an integer when ``integer``)."""
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        kind = "an integer" if integer else "a number"
        valid = isinstance(value, int) if integer else isinstance(value, int | float)
        if not valid or isinstance(value, bool) or not math.isfinite(value):
            raise self.fail(key, f"must be {kind}, got {_kind(value)}", value)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            low = "" if minimum is None else f"at least {minimum:g}"
            high = "" if maximum is None else f"at most {maximum:g}"
            raise self.fail(key, f"must be {' and '.join(p for p in (low, high) if p)}, got {value!r}", value)
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {_kind(value)}", value)
        return value

    def mapping(self, key: str) -> Mapping[str, Any]:
        """An object field (required)."""
        value = self.raw(key)
        if not isinstance(value, Mapping):
            raise self.fail(key, f"must be an object, got {_kind(value)}", value)
        return value

    def done(self, kind: str, extra: Iterable[str] = ()) -> None:
        """Refuse a field the grader type does not have (``extra``: fields it accepts and ignores)."""
        known = self.read | {"type"} | set(extra)
        for key in self.spec:
            if key not in known:
                fields = ", ".join(sorted(known))
                raise self.fail(str(key), f"a {kind} grader has no such field (its fields: {fields})")


def _kind(value: Any) -> str:
    """What a JSON value is, for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {short(repr(value), 60)}"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return type(value).__name__
