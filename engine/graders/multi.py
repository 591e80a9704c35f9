"""OpenAI's ``multi`` grader: named sub-graders (``graders``) and a formula over their names
(``calculate_output``, ``engine.graders.formula``) that makes one reward of their scores.

A sub-grader that fails on a sample scores 0 there and its error is reported (``"b: ..."``);
the formula still runs. A formula that cannot be computed for a sample (a division by zero)
fails that sample. The sub-graders' scores are ``GradeResult.sub_rewards``, a nested ``multi``'s
own ones under ``outer.inner``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.graders.base import MAX_TEXT, ErrorKind, Fields, Grader, Scores, short
from engine.graders.formula import Formula, FormulaError

MAX_GRADERS = 32
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class MultiGrader(Grader):
    """Sub-graders by name and the formula that combines their scores."""

    type = "multi"

    def __init__(self, name: str, graders: dict[str, Grader], formula: Formula) -> None:
        super().__init__(name)
        self.graders, self.formula = graders, formula

    @classmethod
    def from_fields(cls, fields: Fields, build: Callable[[Any, str], Grader]) -> MultiGrader:
        """Read a ``multi`` grader; ``build(spec, path)`` makes each sub-grader."""
        name = fields.name(cls.type)
        given = fields.mapping("graders")
        if not given:
            raise fields.fail("graders", "give at least one grader, by name")
        if len(given) > MAX_GRADERS:
            raise fields.fail("graders", f"at most {MAX_GRADERS} graders, got {len(given)}")
        graders: dict[str, Grader] = {}
        try:
            for key, spec in given.items():
                if not isinstance(key, str) or not _NAME.match(key) or key in ("min", "max"):
                    message = (
                        f"{key!r} cannot be named in calculate_output: a name is letters, digits "
                        "and _, not starting with a digit, and not min or max"
                    )
                    raise fields.fail("graders", message, key)
                if isinstance(spec, Mapping) and "name" not in spec:
                    spec = {**spec, "name": key}
                graders[key] = build(spec, f"{fields.at('graders')}.{key}")
            text = fields.text("calculate_output", max_length=MAX_TEXT)
            try:
                formula = Formula.parse(text, set(graders))
            except FormulaError as exc:
                raise fields.fail("calculate_output", str(exc), text) from exc
            fields.done(cls.type)
        except BaseException:
            for grader in graders.values():
                grader.close()
            raise
        return cls(name, graders, formula)

    def spec(self) -> dict[str, Any]:
        return {
            "type": self.type,
            "name": self.name,
            "graders": {key: grader.spec() for key, grader in self.graders.items()},
            "calculate_output": self.formula.text,
        }

    def scores(self, samples: list[dict[str, Any]], items: Sequence[Mapping[str, Any]]) -> Scores:
        count = len(samples)
        parts = {key: grader.scores(samples, items) for key, grader in self.graders.items()}
        out = Scores([], [], [])
        for key, part in parts.items():
            out.sub[key] = list(part.values)
            for inner, values in part.sub.items():
                out.sub[f"{key}.{inner}"] = list(values)
        for i in range(count):
            errors = [f"{key}: {part.errors[i]}" for key, part in parts.items() if part.errors[i]]
            kinds: list[ErrorKind] = [k for part in parts.values() if (k := part.kinds[i]) is not None]
            value = 0.0
            try:
                value = self.formula.evaluate({key: part.values[i] for key, part in parts.items()})
            except FormulaError as exc:
                errors.append(f"calculate_output: {exc}")
                kinds.append("formula")
            out.values.append(value)
            out.errors.append(short("; ".join(errors)) if errors else None)
            out.kinds.append(kinds[0] if kinds else None)
        return out

    def close(self) -> None:
        for grader in self.graders.values():
            grader.close()
