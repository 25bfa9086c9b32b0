"""The example's tool: a calculator for integer arithmetic, in TRL's tool form (type hints and a Google-style
docstring, from which ``transformers.utils.get_json_schema`` reads its schema)."""

from __future__ import annotations

import ast
import operator

__all__ = ["calculator"]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError(f"not an integer expression with + - * / and parentheses: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: integers joined by + - * / and parentheses
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    value = _value(tree.body)
    if isinstance(value, float):
        value = int(value) if value.is_integer() else round(value, 6)
    return str(value)
