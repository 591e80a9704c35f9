"""A ``multi`` grader's ``calculate_output``: a formula over its sub-graders' names, e.g.
``"0.5 * a + 0.5 * b"`` or ``"min(a, b) - 0.1 * (1 - c)"``.

The grammar is small and parsed here, never by ``eval``: numbers, names, ``+ - * /``, unary
signs, parentheses and the functions ``min`` and ``max`` of one or more arguments::

    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/") unary)*
    unary   := ("+" | "-") unary | atom
    atom    := NUMBER | NAME | ("min" | "max") "(" sum ("," sum)* ")" | "(" sum ")"
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

MAX_LENGTH = 4096
MAX_DEPTH = 64
FUNCTIONS = ("min", "max")
_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>[-+*/(),]))"
)


class FormulaError(ValueError):
    """A formula that does not parse, names an unknown variable, or cannot be computed."""


@dataclass(frozen=True)
class Number:
    value: float


@dataclass(frozen=True)
class Name:
    name: str


@dataclass(frozen=True)
class Negate:
    operand: Node


@dataclass(frozen=True)
class Chain:
    """``first op1 x1 op2 x2 ...`` at one precedence level, left to right (``+ -`` or ``* /``)."""

    first: Node
    rest: tuple[tuple[str, Node], ...]


@dataclass(frozen=True)
class Call:
    function: str
    arguments: tuple[Node, ...]


Node = Union[Number, Name, Negate, Chain, Call]  # noqa: UP007 - a runtime alias of dataclasses


@dataclass(frozen=True)
class Formula:
    """A parsed formula: ``Formula.parse(text, names)``, then ``evaluate(values)``."""

    text: str
    root: Node

    @classmethod
    def parse(cls, text: str, names: frozenset[str] | set[str]) -> Formula:
        """Parse ``text``; every name must be in ``names``.

        Raises:
            FormulaError: it does not parse, or names something else.
        """
        if len(text) > MAX_LENGTH:
            raise FormulaError(f"a formula of at most {MAX_LENGTH} characters, got {len(text)}")
        parser = _Parser(text, frozenset(names))
        root = parser.sum(0)
        if parser.peek() is not None:
            raise FormulaError(f"unexpected {parser.peek()!r} at character {parser.position + 1}")
        return cls(text, root)

    def names(self) -> set[str]:
        """The names the formula uses."""
        found: set[str] = set()
        stack: list[Node] = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, Name):
                found.add(node.name)
            elif isinstance(node, Negate):
                stack.append(node.operand)
            elif isinstance(node, Chain):
                stack.extend((node.first, *(n for _, n in node.rest)))
            elif isinstance(node, Call):
                stack.extend(node.arguments)
        return found

    def evaluate(self, values: Mapping[str, float]) -> float:
        """The formula's value with each name bound to ``values[name]``.

        Raises:
            FormulaError: a division by zero, or a result that is not a finite number.
        """
        result = _evaluate(self.root, values)
        if not math.isfinite(result):
            raise FormulaError(f"the formula's value is {result}, not a finite number")
        return result


def _evaluate(node: Node, values: Mapping[str, float]) -> float:
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Name):
        return float(values[node.name])
    if isinstance(node, Negate):
        return -_evaluate(node.operand, values)
    if isinstance(node, Call):
        arguments = [_evaluate(a, values) for a in node.arguments]
        return min(arguments) if node.function == "min" else max(arguments)
    value = _evaluate(node.first, values)
    for op, operand in node.rest:
        right = _evaluate(operand, values)
        if op == "+":
            value += right
        elif op == "-":
            value -= right
        elif op == "*":
            value *= right
        elif right == 0:
            raise FormulaError("division by zero")
        else:
            value /= right
    return value


class _Parser:
    """Recursive descent over the tokens of one formula."""

    def __init__(self, text: str, names: frozenset[str]) -> None:
        self.text, self.names = text, names
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, offset)
        offset = 0
        while offset < len(text):
            if text[offset:].strip() == "":
                break
            match = _TOKEN.match(text, offset)
            if match is None:
                at = len(text[offset:]) - len(text[offset:].lstrip()) + offset
                raise FormulaError(f"unexpected {text[at]!r} at character {at + 1}")
            kind = match.lastgroup or "op"
            self.tokens.append((kind, match.group(kind), match.start(kind)))
            offset = match.end()
        self.index = 0

    @property
    def position(self) -> int:
        return self.tokens[self.index][2] if self.index < len(self.tokens) else len(self.text)

    def peek(self) -> str | None:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else None

    def take(self) -> tuple[str, str, int]:
        if self.index >= len(self.tokens):
            raise FormulaError("the formula ends too early")
        token = self.tokens[self.index]
        self.index += 1
        return token

    def expect(self, text: str) -> None:
        at = self.position
        got = self.take()[1]
        if got != text:
            raise FormulaError(f"expected {text!r} at character {at + 1}, got {got!r}")

    def sum(self, depth: int) -> Node:
        first, rest = self.product(depth), []
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            rest.append((op, self.product(depth)))
        return Chain(first, tuple(rest)) if rest else first

    def product(self, depth: int) -> Node:
        first, rest = self.unary(depth), []
        while self.peek() in ("*", "/"):
            op = self.take()[1]
            rest.append((op, self.unary(depth)))
        return Chain(first, tuple(rest)) if rest else first

    def unary(self, depth: int) -> Node:
        if depth > MAX_DEPTH:
            raise FormulaError(f"the formula nests deeper than {MAX_DEPTH} levels")
        if self.peek() in ("+", "-"):
            op = self.take()[1]
            operand = self.unary(depth + 1)
            return Negate(operand) if op == "-" else operand
        return self.atom(depth)

    def atom(self, depth: int) -> Node:
        at = self.position
        kind, text, _ = self.take()
        if kind == "number":
            if not math.isfinite(float(text)):
                raise FormulaError(f"the number {text} at character {at + 1} is too large")
            return Number(float(text))
        if kind == "name":
            if text in FUNCTIONS and self.peek() == "(":
                self.take()
                arguments = [self.sum(depth + 1)]
                while self.peek() == ",":
                    self.take()
                    arguments.append(self.sum(depth + 1))
                self.expect(")")
                return Call(text, tuple(arguments))
            if text not in self.names:
                known = ", ".join(sorted(self.names)) or "none"
                raise FormulaError(f"{text!r} at character {at + 1} is not a grader's name (names: {known})")
            return Name(text)
        if text == "(":
            node = self.sum(depth + 1)
            self.expect(")")
            return node
        raise FormulaError(f"unexpected {text!r} at character {at + 1}")
