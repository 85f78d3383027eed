"""The calculator tool of the multi-turn arithmetic task: `calc(expression)` evaluates integer
arithmetic (+ - * // % ** and parentheses) and returns the value as text.

It is a tool, so it runs in the sandbox (pipeline_rl/tasks/sandbox.py), loaded by file path in a bare
interpreter: standard library only. It walks the expression's syntax tree itself (no eval), and the
sandbox's limits stop what a tree walk cannot, such as 9**9**9.
"""

import ast
import operator

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,  # integer arithmetic: 7/2 is 3
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(f"not integer arithmetic: {ast.unparse(node)[:80]}")


def calc(expression: str) -> str:
    return str(_value(ast.parse(str(expression), mode="eval").body))
