"""A small expression language over a bench's JSON result: what a target judges and what the
README's figures cite.

    efficiency_median                 a field
    points.*.stall_max_ms             a dotted path; `*` takes every item of a list or dict
    step_s.1                          a dict key or list index that is a number
    max(points.*.stall_max_ms)        min, max, median, sum, len, all, any of the items
    join_s / broadcast_s              + - * / between numbers (`*` apart from a path's `.*`);
                                      a list with a number, or two lists of one length, item by item
    min(per_seed.*.heldout_last - per_seed.*.heldout_control_last)

`parse` checks an expression without a result; `evaluate` returns a number, bool, string or a
`Many` (the items a `*` took, each labelled with the path of its item). A path that is not in
the result, a null where a number is needed or an empty list under an aggregate raises
`Missing`: a target then counts as missed. min and max also say which item they took.
"""

from __future__ import annotations

import operator
import re
import statistics
from dataclasses import dataclass, field
from functools import cache

TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<path>[A-Za-z_]\w*(?:\.(?:\*|\w+))*)"
                   r"|(?P<op>[-+*/(),]))")
FUNCTIONS = ("min", "max", "median", "sum", "len", "all", "any")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


class Missing(Exception):
    """The expression names what the result does not have (or has as null)."""


class ExprError(ValueError):
    """The expression itself does not parse."""


@dataclass
class Many:
    """Items a `*` took: (label, value) pairs in the result's order; the label is the item's path."""

    items: list[tuple[str, object]] = field(default_factory=list)

    def values(self) -> list:
        return [v for _, v in self.items]


def tokenize(text: str) -> list[tuple[str, str]]:
    out, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ExprError(f"cannot read {text[pos:]!r} in {text!r}")
        out.append((m.lastgroup, m.group(m.lastgroup)))
        pos = m.end()
    return out


class _Parser:
    """Recursive descent to a tree of tuples: ("num", v), ("path", p), ("call", f, x), ("op", o, a, b)."""

    def __init__(self, text: str):
        self.text, self.tokens, self.pos = text, tokenize(text), 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def take(self, want: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok[0] == "end" or (want is not None and tok != ("op", want)):
            raise ExprError(f"expected {want or 'more'} in {self.text!r}")
        self.pos += 1
        return tok

    def whole(self):
        tree = self.binary(("+", "-"))
        if self.peek()[0] != "end":
            raise ExprError(f"unexpected {self.peek()[1]!r} in {self.text!r}")
        return tree

    def binary(self, ops: tuple[str, str]):
        lower = (lambda: self.binary(("*", "/"))) if ops == ("+", "-") else self.atom
        tree = lower()
        while self.peek()[0] == "op" and self.peek()[1] in ops:
            op = self.take()[1]
            tree = ("op", op, tree, lower())
        return tree

    def atom(self):
        kind, text = self.take()
        if kind == "num":
            return ("num", float(text) if any(c in text for c in ".eE") else int(text))
        if (kind, text) == ("op", "("):
            tree = self.binary(("+", "-"))
            self.take(")")
            return tree
        if kind == "path" and self.peek() == ("op", "("):
            if text not in FUNCTIONS:
                raise ExprError(f"unknown function {text!r} in {self.text!r} (known: {', '.join(FUNCTIONS)})")
            self.take("(")
            tree = self.binary(("+", "-"))
            self.take(")")
            return ("call", text, tree)
        if kind == "path":
            return ("path", text)
        raise ExprError(f"unexpected {text!r} in {self.text!r}")


@cache
def parse(text: str) -> tuple:
    """The expression's tree; ExprError if it does not parse."""
    return _Parser(text).whole()


def evaluate(result: dict, text: str) -> tuple[object, str | None]:
    """(value, the label of the item min/max took, else None)."""
    at: list[str] = []
    return _eval(parse(text), result, at), (at[-1] if at else None)


def _eval(tree: tuple, result: dict, at: list[str]):
    kind = tree[0]
    if kind == "num":
        return tree[1]
    if kind == "path":
        return lookup(result, tree[1])
    if kind == "op":
        return arith(tree[1], _eval(tree[2], result, at), _eval(tree[3], result, at))
    return aggregate(tree[1], _eval(tree[2], result, at), at)


def aggregate(name: str, value, at: list[str]):
    items = value.items if isinstance(value, Many) else [("", value)]
    if name == "len":
        return len(items)
    if not items:
        raise Missing(f"{name}() of no items")
    if name in ("all", "any"):
        return (all if name == "all" else any)(bool(v) for _, v in items)
    nums = [(k, number(v, k)) for k, v in items]
    if name in ("min", "max"):
        k, v = (min if name == "min" else max)(nums, key=lambda kv: kv[1])
        if k:
            at.append(k)
        return v
    vals = [v for _, v in nums]
    return statistics.median(vals) if name == "median" else sum(vals)


def lookup(result, path: str):
    """The value at a dotted path; a Many where it has a `*`."""
    nodes, many = [("", result)], False
    for seg in path.split("."):
        nxt = []
        for label, node in nodes:
            here = f"{label}.{seg}" if label else seg
            if seg == "*":
                if isinstance(node, dict):
                    nxt += [(f"{label}.{k}" if label else str(k), v) for k, v in node.items()]
                elif isinstance(node, list):
                    nxt += [(f"{label}.{i}" if label else str(i), v) for i, v in enumerate(node)]
                else:
                    raise Missing(f"{here}: not a list or dict")
            elif isinstance(node, dict) and seg in node:  # past a `*` the label stays the item's
                nxt.append((label if many else here, node[seg]))
            elif isinstance(node, list) and seg.isdigit() and int(seg) < len(node):
                nxt.append((label if many else here, node[int(seg)]))
            else:
                raise Missing(f"{here}: not in the result")
        nodes, many = nxt, many or seg == "*"
    return Many(nodes) if many else nodes[0][1]


def number(value, where: str = "") -> float:
    if value is None:
        raise Missing(f"{where or 'a value'} is null")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Missing(f"{where or 'a value'} is not a number: {value!r}")
    return value


def arith(op: str, a, b):
    if isinstance(a, Many) or isinstance(b, Many):
        ia = a.items if isinstance(a, Many) else None
        ib = b.items if isinstance(b, Many) else None
        if ia is not None and ib is not None and len(ia) != len(ib):
            raise Missing(f"lists of {len(ia)} and {len(ib)} items")
        n = len(ia if ia is not None else ib)
        left = ia if ia is not None else [("", a)] * n
        right = ib if ib is not None else [("", b)] * n
        return Many([(ka or kb, arith(op, va, vb)) for (ka, va), (kb, vb) in zip(left, right)])
    x, y = number(a), number(b)
    if op == "/" and y == 0:
        raise Missing("division by zero")
    return OPS[op](x, y)
