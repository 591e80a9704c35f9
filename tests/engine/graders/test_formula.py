"""A multi grader's formula: parsed by our own small parser, never eval()."""

from __future__ import annotations

import re

import pytest

from engine.graders.formula import Formula, FormulaError

NAMES = {"a", "b", "c"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5 * a + 0.5 * b", 0.5 * 0.2 + 0.5 * 0.8),
        ("a + b * c", 0.2 + 0.8 * 0.5),
        ("(a + b) * c", (0.2 + 0.8) * 0.5),
        ("a - b - c", 0.2 - 0.8 - 0.5),  # left to right
        ("a / b / c", 0.2 / 0.8 / 0.5),
        ("-a + +b", -0.2 + 0.8),
        ("--a", 0.2),
        ("min(a, b, c)", 0.2),
        ("max(a, b) - min(b, c)", 0.8 - 0.5),
        ("max(a)", 0.2),
        ("2e-1 * 10 + .5", 2.5),
        ("1", 1.0),
        ("  a\t*\n3 ", 0.6000000000000001),
    ],
)
def test_a_formula_computes_what_it_says(text: str, expected: float) -> None:
    formula = Formula.parse(text, NAMES)
    assert formula.evaluate({"a": 0.2, "b": 0.8, "c": 0.5}) == pytest.approx(expected)


def test_the_names_a_formula_uses() -> None:
    assert Formula.parse("min(a, 1) + (c * 2)", NAMES).names() == {"a", "c"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a + d", "'d' at character 5 is not a grader's name (names: a, b, c)"),
        ("a +", "the formula ends too early"),
        ("a b", "unexpected 'b' at character 3"),
        ("(a + b", "the formula ends too early"),
        ("a + b)", "unexpected ')' at character 6"),
        ("a ** 2", "unexpected '*' at character 4"),
        ("__import__('os')", """unexpected "'" at character 12"""),
        ("__import__(a)", "'__import__' at character 1 is not a grader's name"),
        ("a.real", "unexpected '.' at character 2"),
        ("min()", "unexpected ')' at character 5"),
        ("abs(a)", "'abs' at character 1 is not a grader's name"),
        ("1e999", "too large"),
        ("a; b", "unexpected ';' at character 2"),
        ("", "the formula ends too early"),
        ("(" * 100 + "a" + ")" * 100, "nests deeper than 64"),
    ],
)
def test_a_bad_formula_is_refused_with_where(text: str, message: str) -> None:
    with pytest.raises(FormulaError, match=re.escape(message)):
        Formula.parse(text, NAMES)


def test_division_by_zero_and_long_chains() -> None:
    formula = Formula.parse("a / b", NAMES)
    with pytest.raises(FormulaError, match="division by zero"):
        formula.evaluate({"a": 1.0, "b": 0.0})
    chain = Formula.parse(" + ".join(["a"] * 1000), NAMES)  # no recursion per term
    assert chain.evaluate({"a": 1.0}) == 1000.0
