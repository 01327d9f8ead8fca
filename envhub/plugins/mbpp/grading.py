"""The trusted half of MBPP grading: what the node decides, never running submission code.

A hidden test is an ``assert`` over calls into the submission: ``assert f(2, [1, 3]) ==
(4, 6)``. The node cuts it in two (:func:`plan`):

- **probes**: the largest parts of the test that name something the submission or the
  setup code defines (``f(2, [1, 3])``), sent as source to the untrusted interpreter
  (``_mbpp_harness.probe``), which runs the submission and reports each probe's value
  as plain data;
- a **template**: the rest of the test with each probe replaced by a placeholder
  (``__v0 == (4, 6)``), checked against a small grammar (:func:`_check`) and evaluated
  here (:func:`judge`) on the decoded values, which are fresh built-in objects.

Invariants:
- No submission code runs in the process that decides the verdict, and the values a
  test expects never reach a process that runs submission code: a probe holds only the
  arguments the test passes.
- A template may use literals, comparisons, arithmetic, boolean logic, subscripts, the
  placeholders, the built-ins of :data:`SAFE_CALLABLES` and ``math``/``cmath``/``sys``
  attributes; nothing else compiles, so a dataset cannot make the node run code either.
  A test outside that grammar is graded ``error`` with the reason.
- A name counts as the submission's when it is not one of those built-ins or modules, or
  when the task's *reference* solution binds it at module level (task 126's ``def sum(a,
  b)`` makes its tests' ``sum(...)`` the function under test). The dataset decides, once
  per task; a submission cannot move a part of a test to its own side by naming things.
"""

from __future__ import annotations

import ast
import builtins
import cmath
import math
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any

SAFE_CALLABLES: dict[str, Any] = {
    name: getattr(builtins, name)
    for name in (
        "abs", "all", "any", "bool", "bytes", "chr", "complex", "dict", "divmod", "enumerate", "float",
        "frozenset", "int", "isinstance", "len", "list", "max", "min", "ord", "range", "repr",
        "reversed", "round", "set", "sorted", "str", "sum", "tuple", "type", "zip",
    )
}  # fmt: skip
MODULES: dict[str, Any] = {"math": math, "cmath": cmath, "sys": sys}
_SYS_ATTRS = frozenset({"getsizeof", "maxsize", "float_info", "int_info"})
_TRUSTED = frozenset(SAFE_CALLABLES) | frozenset(MODULES) | frozenset({"True", "False", "None"})
_BIG = 10_000  # the largest exponent or shift a template may use (a dataset is not to hang the node)
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)

_NODES = (
    ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.Call, ast.keyword, ast.Constant,
    ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Subscript, ast.Slice, ast.Name, ast.Attribute, ast.IfExp,
    ast.Load, ast.Starred, ast.cmpop, ast.boolop, ast.unaryop, ast.operator,
)  # fmt: skip


@dataclass(frozen=True)
class TestPlan:
    """One hidden test, cut for grading: the probes' sources and the compiled template,
    or why it cannot be graded (``error``)."""

    text: str
    probes: tuple[str, ...]
    template: CodeType | None
    error: str | None = None


def top_level_names(code: str) -> frozenset[str]:
    """The names a solution binds at module level (functions, classes, assignments, loop
    and ``with`` targets, imports but of the modules the grader knows as such): the names
    a test sees as the solution's."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return frozenset()
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                bound = alias.asname or alias.name.split(".")[0]
                if not (bound in MODULES and isinstance(stmt, ast.Import) and alias.name == bound):
                    names.add(bound)
        else:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                    names.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    break  # names inside a nested scope are its own
    return frozenset(names)


def plan(text: str, shadowed: frozenset[str] = frozenset()) -> TestPlan:
    """Cut one test (``assert X[, msg]``) into probes and a template; ``shadowed``: the
    trusted names the task's reference solution rebinds, which count as the solution's."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        return TestPlan(text, (), None, f"the test does not parse: {e.msg} (line {e.lineno})")
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return TestPlan(text, (), None, "the grader takes tests of one assert statement only")
    trusted = _TRUSTED - shadowed
    probes: list[str] = []

    def untrusted(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id not in trusted for n in ast.walk(node))

    inside: list[str] = []  # why the test cannot be cut, if it cannot

    class Cut(ast.NodeTransformer):
        def generic_visit(self, node: ast.AST) -> ast.AST:
            if isinstance(node, ast.expr) and untrusted(node) and _probe_root(node, trusted):
                if isinstance(node, _SCOPED):
                    # Its values would be computed, and its expected ones seen, where the
                    # submission runs: such a test cannot be graded on plain data.
                    inside.append(f"it calls the submission inside a {type(node).__name__}")
                source = ast.get_source_segment(text, node) or ast.unparse(node)
                probes.append(f"(\n{source}\n)")  # it may span lines or end in a comment
                return ast.copy_location(ast.Name(id=f"__v{len(probes) - 1}", ctx=ast.Load()), node)
            return super().generic_visit(node)

    expression = ast.Expression(body=Cut().visit(tree.body[0].test))
    ast.fix_missing_locations(expression)
    why = inside[0] if inside else _check(expression, len(probes))
    if why:
        return TestPlan(text, tuple(probes), None, f"the test cannot be graded safely: {why}")
    return TestPlan(text, tuple(probes), compile(expression, "<test>", "eval"))


def _probe_root(node: ast.expr, trusted: frozenset[str]) -> bool:
    """Whether ``node`` is cut out whole: a name of the submission's, or an expression
    whose outermost operation is the submission's (a call of its function, an attribute
    or subscript of its value). Trusted operations around it stay in the template."""
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Call):
        return _head_untrusted(node.func, trusted)
    if isinstance(node, (ast.Attribute, ast.Subscript)):
        return _head_untrusted(node.value, trusted)
    return isinstance(node, (*_SCOPED, ast.NamedExpr))


def _head_untrusted(node: ast.expr, trusted: frozenset[str]) -> bool:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.value if not isinstance(node, ast.Call) else node.func
    return not (isinstance(node, ast.Name) and node.id in trusted) and not isinstance(node, ast.Constant)


def _check(expression: ast.Expression, n_probes: int) -> str | None:
    """Why the template is outside the grammar, or None."""
    placeholders = {f"__v{i}" for i in range(n_probes)}
    for node in ast.walk(expression):
        if not isinstance(node, _NODES):
            return f"it uses {type(node).__name__}"
        if isinstance(node, ast.Name) and node.id not in placeholders and node.id not in _TRUSTED:
            return f"it names {node.id!r}"
        if isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in MODULES) or node.attr.startswith("_"):
                return f"it reads the attribute {ast.unparse(node)}"
            if node.value.id == "sys" and node.attr not in _SYS_ATTRS:
                return f"it reads sys.{node.attr}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift)):
            if not (isinstance(node.right, ast.Constant) and isinstance(node.right.value, (int, float))):
                return "it raises to a power or shifts by an amount that is not a literal"
            if abs(node.right.value) > _BIG:
                return f"it raises to a power or shifts by {node.right.value}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, int) and abs(side.value) > 10**7:
                    return f"it multiplies by {side.value}"
    return None


@dataclass(frozen=True)
class Record:
    """A dataclass instance the submission returned, as data: its class's name and the
    fields it compares by. Equal to a record of the same name and fields only."""

    name: str
    fields: tuple[tuple[str, Any], ...]


def decode(data: Any) -> Any:
    """The value a probe reported (``_mbpp_harness.plain``), as fresh built-in objects."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, dict) and len(data) == 1:
        ((tag, payload),) = data.items()
        if tag == "l":
            return [decode(x) for x in payload]
        if tag == "t":
            return tuple(decode(x) for x in payload)
        if tag == "s":
            return {decode(x) for x in payload}
        if tag == "fs":
            return frozenset(decode(x) for x in payload)
        if tag == "d":
            return {decode(k): decode(v) for k, v in payload}
        if tag == "i":
            return int(payload)
        if tag == "f":
            return float(payload)
        if tag == "c":
            return complex(decode(payload[0]), decode(payload[1]))
        if tag == "b":
            return bytes.fromhex(payload)
        if tag == "ba":
            return bytearray.fromhex(payload)
        if tag == "o":
            return Record(str(payload[0]), tuple((str(k), decode(v)) for k, v in payload[1]))
    raise ValueError(f"not a reported value: {str(data)[:200]}")


def judge(test: TestPlan, values: list[Any]) -> tuple[str, str | None]:
    """``(status, error)`` of one test from its probes' reported values."""
    if test.template is None:
        return "error", test.error
    if len(values) != len(test.probes):
        return "error", f"the interpreter reported {len(values)} values for {len(test.probes)} probes"
    try:
        scope = {**SAFE_CALLABLES, **MODULES, **{f"__v{i}": decode(v) for i, v in enumerate(values)}}
        outcome = eval(test.template, {"__builtins__": {}}, scope)  # noqa: S307 (a checked template, see _check)
        return ("passed", None) if bool(outcome) else ("failed", None)
    except Exception as e:  # an exception on the test's side, as a crash in the assert was
        return "error", f"{type(e).__name__}: {e}"[:2000]
