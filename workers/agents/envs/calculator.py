"""calculator: a tool-use environment. The model calls a calculator tool, reads the result, then answers.

Each sample is an arithmetic question with numbers too large to do reliably in one's head. An action is either a
tool call, written ``calculator(37 * 48 - 125)`` or as JSON ``{"name": "calculator", "arguments": {"expression":
"37 * 48 - 125"}}``, answered with ``calculator result: 1651``, or a final ``answer(1651)``, which ends the episode
(reward 1.0 when it equals the exact value).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from workers.agents.environment import Environment, Step, register_environment

NUM_SAMPLES = 200
_MAX_MAGNITUDE = 10**15
_CALL = re.compile(r"calculator\((.*)\)", re.DOTALL)
_ANSWER = re.compile(r"answer\((.*?)\)", re.DOTALL)
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the message is shown to the model)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary minus, parentheses; nothing else.

    Raises:
        CalculatorError: syntax it does not accept, division by zero, or a value beyond 1e15 in magnitude.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"cannot parse {expression.strip()!r}") from err
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int | float:
    value: int | float
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise CalculatorError(f"exponent {right} is too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as err:
            raise CalculatorError("division by zero") from err
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    else:
        raise CalculatorError(f"unsupported expression {ast.unparse(node)!r}: use numbers, + - * / // % ** and ()")
    if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
        raise CalculatorError(f"the value of {ast.unparse(node)!r} is out of range")
    return value


def problem(index: int) -> tuple[str, int]:
    """Sample ``index``: (question, exact integer answer)."""
    rng = random.Random(f"calculator-{index}")
    a, b, c = rng.randint(100, 9999), rng.randint(12, 999), rng.randint(100, 99999)
    op = rng.choice(["+", "-"])
    return f"What is {a} * {b} {op} {c}?", a * b + (c if op == "+" else -c)


def _tool_call(action: str) -> str | None:
    """The expression of a calculator call in ``action`` (function or JSON form), or None."""
    text = action.strip()
    if text.startswith("{"):
        try:
            call = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if call.get("name") == "calculator" and isinstance(arguments, dict):
            return str(arguments.get("expression", ""))
        return None
    match = _CALL.search(text)
    return None if match is None else match.group(1)


@register_environment("calculator")
class CalculatorEnvironment(Environment):
    """Arithmetic questions answered with the help of a calculator tool."""

    description = (
        "Arithmetic questions with a calculator tool. Call it as calculator(EXPRESSION) or as JSON "
        '{"name": "calculator", "arguments": {"expression": "..."}}; finish with answer(NUMBER). '
        "Reward 1.0 for the exact value, else 0.0."
    )
    max_turns = 4

    @classmethod
    def sample_ids(cls) -> list[str]:
        return [f"calc-{i:03d}" for i in range(NUM_SAMPLES)]

    def reset(self, sample_id: str, config: dict[str, Any]) -> str:
        index = self.sample_ids().index(self.resolve_sample_id(sample_id))
        question, self.answer = problem(index)
        self.tool_calls = 0
        return (
            f"{question}\nYou may call the tool calculator(EXPRESSION) and will be shown its result. "
            "When you know the value, reply answer(NUMBER)."
        )

    def step(self, action: str) -> Step:
        expression = _tool_call(action)
        if expression is not None:
            self.tool_calls += 1
            try:
                shown = f"calculator result: {_format(evaluate(expression))}"
            except CalculatorError as err:
                shown = f"calculator error: {err}"
            return Step(shown, 0.0, False, {"tool_calls": self.tool_calls})
        answer = _ANSWER.search(action)
        if answer is None:
            return Step(
                "Call calculator(EXPRESSION) or reply answer(NUMBER).", 0.0, False, {"tool_calls": self.tool_calls}
            )
        success = _parse_number(answer.group(1)) == self.answer
        return Step(None, float(success), True, {"success": success, "tool_calls": self.tool_calls})


def _format(value: int | float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def _parse_number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None
