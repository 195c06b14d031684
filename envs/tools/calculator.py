"""`calculator`: arithmetic on numbers evaluated by walking the AST (never eval)."""
from __future__ import annotations

import ast
import math
import operator
from typing import Any

from rlfactory_megatron.envs.tools.base import BaseTool, ToolResult
from rlfactory_megatron.envs.tools.registry import register_tool

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "exp": math.exp,
    "log": math.log, "log10": math.log10, "sin": math.sin, "cos": math.cos, "tan": math.tan, "floor": math.floor,
    "ceil": math.ceil,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
# Bounds that keep one expression from eating the tool actor's CPU or memory (9**9**9).
_MAX_EXPRESSION_CHARS = 2000
_MAX_RESULT_BITS = 100_000


class CalculationError(ValueError):
    pass


@register_tool("calculator")
class CalculatorTool(BaseTool):
    name = "calculator"
    description = "Evaluate an arithmetic expression: + - * / // % **, parentheses, and abs round min max sqrt exp log log10 sin cos tan floor ceil pi e."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2 / sqrt(16)"}},
        "required": ["expression"],
    }

    async def execute(self, args: dict[str, Any]) -> ToolResult:
        try:
            value = evaluate(args["expression"])
        except (CalculationError, ArithmeticError, ValueError, TypeError) as exc:
            return ToolResult(f"error: {exc}", {"error_kind": "calculation"}, is_error=True)
        return ToolResult(format_number(value))


def evaluate(expression: str) -> int | float:
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise CalculationError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculationError(f"not an arithmetic expression: {exc.msg}") from None
    return _eval(tree.body)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _check_size(type(node.op), left, right)
        return _BINARY[type(node.op)](left, right)
    if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_eval(a) for a in node.args))
    raise CalculationError(f"unsupported syntax: {ast.unparse(node)!r}")


def _check_size(op: type, left: int | float, right: int | float) -> None:
    if isinstance(left, int) and isinstance(right, int):
        bits = {ast.Pow: max(left.bit_length(), 1) * abs(right), ast.Mult: left.bit_length() + right.bit_length()}.get(op, 0)
        if bits > _MAX_RESULT_BITS:
            raise CalculationError("result too large")
