"""What every grader shares: the result of a batch, the ``Grader`` base class (each grader class
registers itself by its type in ``GRADERS``), ``build`` (the grader of a checked spec, any type),
and the sample a model answer becomes."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "type" in cls.__dict__:
            GRADERS[cls.type] = cls

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    @abstractmethod
    def from_spec(cls, spec: Any, *, name: str | None = None, field: str = "grader") -> Grader:
        """The grader of ``spec``, a checked spec of this type (``engine.graders.spec``).

        Args:
            spec: the spec.
            name: its name (default: the spec's, else its type).
            field: the spec's dotted path, for errors.

        Raises:
            ConfigError: it cannot be built (a ``python`` grader's source defines no ``grade``).
        """

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


# type -> grader class: each registers itself (``Grader.__init_subclass__``)
GRADERS: dict[str, type[Grader]] = {}


def build(spec: Any, *, name: str | None = None, field: str = "grader") -> Grader:
    """The grader of ``spec``, a checked spec of any type (``Grader.from_spec`` of its class)."""
    return GRADERS[spec.type].from_spec(spec, name=name, field=field)


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
