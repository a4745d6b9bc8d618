"""The calculator of config/examples/qwen3.5-9b-tools-lora-grpo-2x8.yaml: one tool the model
may call during its GRPO rollouts (and its evaluation), as `grpo.tools` names it.

A tool is a plain function with type hints and a docstring whose ``Args:`` describe each
argument: TRL turns them into the JSON schema the chat template shows the model. What it
returns is the tool turn's text; what it raises is too (the run goes on; docs/agents.md).
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def calculate(expression: str) -> str:
    """Work out an arithmetic expression.

    Args:
        expression: Numbers joined by +, -, *, /, //, % and ** with parentheses, such as
            "(12 + 30) * 4".
    """
    value = _value(ast.parse(expression.replace(",", ""), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)
