"""LaTeX -> Python-expression translator and the safety screen in front of sympy (docs/rewards.md, step 3.4).

Our own, for the subset final answers use: ``sympy.parsing.latex`` needs antlr4 or lark at a pinned
version. ``screen`` rejects explosive input before sympy sees it; nothing here evaluates model output.
"""

from __future__ import annotations

import ast
import re
from typing import Optional

MAX_CHARS = 400
MAX_NODES = 300
MAX_DEPTH = 40
MAX_EXPONENT = 1000
MAX_INT_DIGITS = 60

FUNCTIONS = {
    "sin": "sin", "cos": "cos", "tan": "tan", "sec": "sec", "csc": "csc", "cot": "cot",
    "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
    "tanh": "tanh", "ln": "log", "log": "log", "exp": "exp",
}
GREEK = {"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
         "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau",
         "upsilon", "phi", "varphi", "chi", "psi", "omega", "Gamma", "Delta", "Theta", "Lambda",
         "Xi", "Sigma", "Phi", "Psi", "Omega"}
CONSTANTS = {"pi": "pi", "infty": "oo", "infinity": "oo"}
IGNORED = {"circ", "mathrm", "mathit", "mathbf", "text", "displaystyle", "left", "right", "cdotp"}
ALLOWED_CALLS = {"sqrt", "Abs", "root"} | set(FUNCTIONS.values())

_TOKEN_RE = re.compile(r"\\[A-Za-z]+|\\.|\d+\.\d*|\.\d+|\d+|[A-Za-z]|\S")


class _Fail(Exception):
    pass


class _Translator:
    """Recursive-descent emitter over LaTeX tokens; inserts explicit ``*`` for juxtaposition."""

    def __init__(self, tokens: list[str]):
        self.toks, self.i = tokens, 0

    def peek(self) -> Optional[str]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise _Fail("unexpected end")
        self.i += 1
        return tok

    def group(self) -> str:
        """A ``{...}`` group or a single atom token (``\\frac12``, ``x^2``)."""
        tok = self.take()
        if tok == "{":
            return self.seq("}")
        if tok in ("(", "["):
            return self.seq(")" if tok == "(" else "]", opened=True)
        return self.atom(tok)

    def atom(self, tok: str) -> str:
        if re.fullmatch(r"\d+\.?\d*|\.\d+", tok):
            return tok
        if re.fullmatch(r"[A-Za-z]", tok):
            return "E" if tok == "e" else tok
        if tok.startswith("\\"):
            name = tok[1:]
            if name in CONSTANTS:
                return CONSTANTS[name]
            if name in GREEK:
                return name + "_"  # "lambda" is a Python keyword
            if name == "frac":
                num, den = self.group(), self.group()
                return f"(({num})/({den}))"
            if name == "sqrt":
                if self.peek() == "[":
                    self.take()
                    index = self.seq("]")
                    return f"(({self.group()})**(1/({index})))"
                return f"sqrt({self.group()})"
            if name in FUNCTIONS:
                return self.function(FUNCTIONS[name])
        raise _Fail(f"unsupported token {tok!r}")

    def function(self, fname: str) -> str:
        power = None
        if self.peek() == "^":
            self.take()
            power = self.group()
        if self.peek() == "_" and fname == "log":  # \log_{b} x
            self.take()
            base = self.group()
            arg = self.group()
            call = f"(log({arg})/log({base}))"
        else:
            call = f"{fname}({self.group()})"
        return f"(({call})**({power}))" if power is not None else call

    def seq(self, close: Optional[str], opened: bool = False) -> str:
        out: list[str] = []
        prev_atom = False
        abs_open = False
        while True:
            tok = self.peek()
            if tok is None:
                if close is not None:
                    raise _Fail("unbalanced group")
                break
            if tok == close or (opened and tok in (")", "]")):
                self.take()
                break
            self.take()
            if tok in ("+", "-"):
                out.append(tok)
                prev_atom = False
            elif tok in ("*", "\\cdot", "\\times", "/", "\\div"):
                out.append("/" if tok in ("/", "\\div") else "*")
                prev_atom = False
            elif tok == "^":
                out.append(f"**({self.group()})")
                prev_atom = True
            elif tok == "_":
                sub = re.sub(r"\W", "", self.group())
                if not out or not re.fullmatch(r"[A-Za-z]\w*", out[-1]) or not sub:
                    raise _Fail("subscript without a name")
                out[-1] = f"{out[-1]}_{sub}"
            elif tok == "|":
                if abs_open:
                    out.append(")")
                    prev_atom = True
                else:
                    out.append(("*" if prev_atom else "") + "Abs(")
                    prev_atom = False
                abs_open = not abs_open
            elif tok.startswith("\\") and tok[1:] in IGNORED or tok == "}":
                continue  # \left, \text, \circ ...: the group that follows is read as-is
            else:
                if tok in ("(", "[", "{"):
                    piece = f"({self.seq({'(': ')', '[': ']', '{': '}'}[tok], opened=tok != '{')})"
                else:
                    piece = self.atom(tok)
                out.append(("*" if prev_atom else "") + piece)
                prev_atom = True
        if abs_open:
            raise _Fail("unbalanced |")
        return "".join(out)


def to_python(latex: str) -> Optional[str]:
    """Translate one scalar LaTeX answer to a Python expression string; None if unsupported."""
    if not latex or len(latex) > MAX_CHARS:
        return None
    try:
        out = _Translator(_TOKEN_RE.findall(latex)).seq(None)
    except (_Fail, RecursionError):
        return None
    return out or None


def _int_digits(node: ast.AST) -> int:
    return len(str(abs(node.value))) if isinstance(node, ast.Constant) and isinstance(node.value, int) else 0


def _contains_pow(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) for n in ast.walk(node))


def screen(expr: str) -> bool:
    """True if ``expr`` is a small, allow-listed arithmetic expression safe to give sympy."""
    if len(expr) > MAX_CHARS * 4 or "__" in expr:
        return False
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES or expr.count("(") > MAX_DEPTH * 4:
        return False
    for node in nodes:
        if isinstance(node, (ast.Expression, ast.Load, ast.Name, ast.operator, ast.unaryop)):
            continue
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, (int, float)) or _int_digits(node) > MAX_INT_DIGITS:
                return False
        elif isinstance(node, ast.UnaryOp):
            continue
        elif isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow) and not _safe_power(node):
                return False
        elif isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in ALLOWED_CALLS) or node.keywords:
                return False
        else:
            return False
    return True


def _safe_power(node: ast.BinOp) -> bool:
    """No towers (a power in an exponent); exponents bounded; powers of powers only small."""
    exp = node.right.operand if isinstance(node.right, ast.UnaryOp) else node.right
    if _contains_pow(exp):
        return False
    const = exp.value if isinstance(exp, ast.Constant) and isinstance(exp.value, (int, float)) else None
    if const is not None and abs(const) > MAX_EXPONENT:
        return False
    return not _contains_pow(node.left) or (const is not None and abs(const) <= 10)
