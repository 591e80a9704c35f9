"""OpenAI's ``multi`` grader: named sub-graders (``graders``) and a formula over their names
(``calculate_output``, ``engine.graders.formula``) that makes one reward of their scores.

A sub-grader that fails on a sample scores 0 there and its error is reported (``"b: ..."``);
the formula still runs. A formula that cannot be computed for a sample (a division by zero)
fails that sample. The sub-graders' scores are ``GradeResult.sub_rewards``, a nested ``multi``'s
own ones under ``outer.inner``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.graders.base import ErrorKind, Grader, Scores, build, short
from engine.graders.formula import Formula, FormulaError
from engine.graders.spec import MultiSpec


class MultiGrader(Grader):
    """Sub-graders by name and the formula that combines their scores."""

    type = "multi"

    def __init__(self, name: str, graders: dict[str, Grader], formula: Formula) -> None:
        super().__init__(name)
        self.graders, self.formula = graders, formula

    @classmethod
    def from_spec(cls, spec: MultiSpec, *, name: str | None = None, field: str = "grader") -> MultiGrader:
        """Build each sub-grader (named by its key unless it has a name); one that cannot be built
        closes those built before it."""
        graders: dict[str, Grader] = {}
        try:
            for key, sub in spec.graders.items():
                graders[key] = build(sub, name=sub.name or key, field=f"{field}.graders.{key}")
        except BaseException:
            for grader in graders.values():
                grader.close()
            raise
        return cls(name or spec.name or cls.type, graders, Formula.parse(spec.calculate_output, set(graders)))

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
