"""Writes the native backend's copies of the reference's API, or checks they are current.

The pure-Python reference (``kvblocks.reference``) is the one place each public docstring
and signature of the backend is written. Two files are generated from it:

* ``rust/kvblocks-py/src/docstrings.rs``: a ``docstring!`` macro holding each docstring,
  callables' opening with their text signature, which the binding's items take as
  ``#[doc = docstring!(BlockPool.touch)]``;
* ``python/kvblocks/_native.pyi``: the stub of ``kvblocks._native``, up to the hand-written
  section on ``kvblocks.vllm``'s native half (whose docstrings live in ``vllm/`` only).

The value classes of ``kvblocks.values`` are not copied: both backends export those very
classes, so the stub imports them and the binding documents none of them.

The binding's ``#[pyo3(signature = ...)]`` is code, not a copy: ``--check`` compares its
parameter names, kinds and defaults with the reference's.

Run ``python tools/api_copies.py`` after changing the reference's API, and ``--check`` to
fail (exit 1, with a diff) when a copy is stale or a binding signature differs.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCSTRINGS_RS = REPO / "rust" / "kvblocks-py" / "src" / "docstrings.rs"
STUB = REPO / "python" / "kvblocks" / "_native.pyi"
LINE_LENGTH = 100
#: Where the stub's hand-written part starts; the file is kept from this line on.
STUB_HAND_WRITTEN = "# kvblocks.vllm's native half"
#: The native classes Python may subclass (``#[pyclass(subclass)]``); the others are final.
SUBCLASSABLE = frozenset({"KVCacheManager"})
#: Dunder methods that are API, beside the public names.
API_DUNDERS = ("__call__", "__getitem__", "__len__")


def reference() -> ModuleType:
    """The installed reference (a dev install is the checkout's)."""
    return importlib.import_module("kvblocks.reference")


#: The module of the value classes both backends export as they are.
SHARED = "kvblocks.values"


def shared(obj: Any) -> bool:
    """Whether ``obj`` is one of the value classes both backends export as they are."""
    return getattr(obj, "__module__", None) == SHARED


# ---------------------------------------------------------------------------- members


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One API member of a backend class, as the stub and the docstrings see it.

    Attributes:
        name: The attribute name.
        kind: ``"property"`` or ``"method"``.
        obj: The reference's object: the property or function.
    """

    name: str
    kind: str
    obj: Any


def members(cls: type) -> Iterator[Member]:
    """The API members of a reference class, in definition order."""
    for name, value in vars(cls).items():
        if name.startswith("_") and name not in API_DUNDERS:
            continue
        if isinstance(value, property):
            yield Member(name, "property", value)
        elif inspect.isfunction(value):
            yield Member(name, "method", value)


@dataclasses.dataclass(frozen=True, slots=True)
class ApiItem:
    """A documented name of the backend.

    Attributes:
        key: ``Class``, ``Class.member`` or ``function``: the ``docstring!`` key.
        obj: The reference's class or function (a property's getter).
        signed: Its binding item has a Python signature of its own: a class (its
            ``#[new]``), function or method, but not a property or a dunder (served by a
            method of another name, or a slot, whose text signature PyO3 writes).
    """

    key: str
    obj: Any
    signed: bool


def api_items(ref: ModuleType) -> Iterator[ApiItem]:
    """Each documented name of the backend, classes followed by their members."""
    for name in sorted(ref.__all__):
        obj = getattr(ref, name)
        if shared(obj):
            continue
        yield ApiItem(name, obj, signed=True)
        if isinstance(obj, type):
            for member in members(obj):
                key = f"{name}.{member.name}"
                if member.kind == "property":
                    yield ApiItem(key, member.obj.fget, signed=False)
                elif member.kind == "method":
                    yield ApiItem(key, member.obj, signed=member.name not in API_DUNDERS)


# ---------------------------------------------------------------------------- docstrings


def text_signature(obj: Any) -> str:
    """CPython's ``__text_signature__`` form of a class's or function's signature."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    text = str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))
    # `$self` marks the receiver, which `inspect` then drops for bound methods.
    return text.replace("(self, ", "($self, ").replace("(self)", "($self)")


def rust_literal(text: str) -> str:
    """``text`` as a Rust raw string literal with the fewest ``#``."""
    hashes = 0
    while f'"{"#" * hashes}' in text:
        hashes += 1
    return f'r{"#" * hashes}"{text}"{"#" * hashes}'


def render_docstrings(ref: ModuleType) -> str:
    arms = []
    for item in api_items(ref):
        doc = inspect.getdoc(item.obj)
        if not doc:
            continue
        if item.signed:
            # CPython reads `name(signature)\n--\n\n` into `__text_signature__`.
            name = item.key.rpartition(".")[2]
            doc = f"{name}{text_signature(item.obj)}\n--\n\n{doc}"
        arms.append(f"    ({item.key}) => {{\n{rust_literal(doc)}\n    }};")
    body = "\n".join(arms)
    return (
        "// @generated by tools/api_copies.py from the docstrings of `kvblocks.reference`:\n"
        "// edit those and run it. Callables' texts open with the signature CPython reads into\n"
        "// `__text_signature__` (so their items say `text_signature = None`).\n"
        "\n"
        "/// The reference's docstring of a backend name: `docstring!(BlockPool.touch)`.\n"
        "macro_rules! docstring {\n"
        f"{body}\n"
        "}\n"
    )


# ---------------------------------------------------------------------------- stub


class Annotations:
    """Rewrites the reference's annotations for the stub, collecting the imports they need.

    A name is looked up where the annotated object is defined. Type aliases of the
    reference are written out (they may name reference classes, which the stub has as
    native ones); the backend's classes stay bare; anything else is imported, under a
    private alias when it comes from kvblocks.
    """

    def __init__(self, backend_names: set[str]) -> None:
        self.backend_names = backend_names
        self.imports: dict[str, set[str]] = {}
        self.aliases: dict[tuple[str, str], str] = {}

    def rewrite(self, text: str, module: str) -> str:
        return ast.unparse(self._expr(ast.parse(text, mode="eval").body, module))

    def _expr(self, node: ast.expr, module: str) -> ast.expr:
        annotations = self

        class Rewriter(ast.NodeTransformer):
            def visit_Constant(self, node: ast.Constant) -> ast.AST:
                if isinstance(node.value, str):
                    return annotations._expr(ast.parse(node.value, mode="eval").body, module)
                return node

            def visit_Name(self, node: ast.Name) -> ast.AST:
                return annotations._name(node.id, module)

        return Rewriter().visit(node)  # type: ignore[no-any-return]

    def _name(self, name: str, module: str) -> ast.expr:
        if name in self.backend_names and module.startswith("kvblocks.reference"):
            return ast.Name(name)
        source, value = definition(name, module)
        if source is None:
            if not hasattr(builtins, name):
                raise LookupError(f"{name} in {module} is neither defined, imported nor a builtin")
            return ast.Name(name)
        if source == module and value is not None:
            return self._expr(value, module)  # a type alias of the reference
        if not source.startswith("kvblocks"):
            self.imports.setdefault(source, set()).add(name)
            return ast.Name(name)
        alias = self.aliases.get((source, name))
        if alias is None:
            alias = f"_{name}"
            if alias in self.aliases.values():
                alias = f"_{source.rpartition('.')[2]}_{name}"
            self.aliases[(source, name)] = alias
        return ast.Name(alias)

    def import_lines(self) -> list[str]:
        """The imports, in isort's sections: standard library, third party, kvblocks."""
        sections: dict[bool, list[str]] = {True: [], False: []}
        for source, names in sorted(self.imports.items()):
            stdlib = source.partition(".")[0] in sys.stdlib_module_names
            sections[stdlib].append(f"from {source} import {', '.join(sorted(names))}")
        first_party = [
            f"from {source} import {name} as {alias}"
            for (source, name), alias in sorted(self.aliases.items())
        ]
        return [*sections[True], "", *sections[False], "", *first_party]


@functools.cache
def module_tree(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise LookupError(f"cannot find the source of {module}")
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, with those under ``if TYPE_CHECKING:`` (or any ``if``)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from top_level(node.body)
        else:
            yield node


def definition(name: str, module: str) -> tuple[str | None, ast.expr | None]:
    """Where ``name`` comes from, seen from ``module``.

    Returns:
        ``(module, None)`` for a class or import source, ``(module, expr)`` for a type
        alias of a reference module (its value), ``(None, None)`` when not found.
    """
    for node in top_level(module_tree(module).body):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if node.module.startswith("kvblocks"):
                        return definition(alias.name, node.module)
                    return node.module, None
        elif isinstance(node, ast.ClassDef) and node.name == name:
            return module, None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if module.startswith("kvblocks.reference") and node.value is not None:
                    return module, node.value
                return module, None
    return None, None


def default_text(value: object) -> str:
    return '"' + value + '"' if isinstance(value, str) else repr(value)


def parameters(
    sig: inspect.Signature, module: str, annotations: Annotations, *, receiver: str | None
) -> list[str]:
    """The stub's parameter list: ``receiver`` first, with the ``/`` and ``*`` markers."""
    params = list(sig.parameters.values())
    if receiver is not None and params and params[0].name in ("self", "cls"):
        params = params[1:]
    texts = [] if receiver is None else [receiver]
    for index, param in enumerate(params):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise NotImplementedError(f"{param} in {module}: the binding has no varargs")
        if param.kind is param.KEYWORD_ONLY and (
            index == 0 or params[index - 1].kind is not param.KEYWORD_ONLY
        ):
            texts.append("*")
        text = param.name
        if param.annotation is not param.empty:
            text += ": " + annotations.rewrite(str(param.annotation), module)
        if param.default is not param.empty:
            equals = " = " if param.annotation is not param.empty else "="
            text += equals + default_text(param.default)
        texts.append(text)
        following = params[index + 1].kind if index + 1 < len(params) else None
        if param.kind is param.POSITIONAL_ONLY and following is not param.POSITIONAL_ONLY:
            texts.append("/")
    return texts


def def_lines(indent: str, head: str, params: list[str], returns: str) -> list[str]:
    """A ``def ... : ...`` line as ruff formats it: on one line, or split."""
    one_line = f"{indent}def {head}({', '.join(params)}) -> {returns}: ..."
    if len(one_line) <= LINE_LENGTH:
        return [one_line]
    inner = f"{indent}    {', '.join(params)}"
    if len(inner) <= LINE_LENGTH and len(f"{indent}) -> {returns}: ...") <= LINE_LENGTH:
        return [f"{indent}def {head}(", inner, f"{indent}) -> {returns}: ..."]
    return [
        f"{indent}def {head}(",
        *(f"{indent}    {p}," for p in params),
        f"{indent}) -> {returns}: ...",
    ]


def class_stub(cls: type, annotations: Annotations) -> list[str]:
    module = cls.__module__
    # A subclassable PyO3 class has its own instance layout.
    lines = ["@disjoint_base" if cls.__name__ in SUBCLASSABLE else "@final"]
    lines.append(f"class {cls.__name__}:")
    ctor = parameters(inspect.signature(cls), module, annotations, receiver="cls")
    lines += def_lines("    ", "__new__", ctor, "Self")
    for member in members(cls):
        if member.kind == "property":
            getter = inspect.signature(member.obj.fget)
            ann = annotations.rewrite(str(getter.return_annotation), module)
            lines += ["    @property", f"    def {member.name}(self) -> {ann}: ..."]
            if member.obj.fset is not None:
                setter = list(inspect.signature(member.obj.fset).parameters.values())[1]
                value = annotations.rewrite(str(setter.annotation), module)
                lines += [
                    f"    @{member.name}.setter",
                    f"    def {member.name}(self, value: {value}) -> None: ...",
                ]
        else:
            sig = inspect.signature(member.obj)
            params = parameters(sig, module, annotations, receiver="self")
            returns = annotations.rewrite(str(sig.return_annotation), module)
            lines += def_lines("    ", member.name, params, returns)
    return lines


def function_stub(func: Callable[..., Any], annotations: Annotations) -> list[str]:
    sig = inspect.signature(func)
    params = parameters(sig, func.__module__, annotations, receiver=None)
    returns = annotations.rewrite(str(sig.return_annotation), func.__module__)
    return def_lines("", func.__name__, params, returns)


STUB_HEADER = """\
# @generated by tools/api_copies.py from `kvblocks.reference` (edit that and run it), up
# to the hand-written section on kvblocks.vllm's native half. The classes are PyO3
# classes, built by `__new__` and final (but `KVCacheManager`); the value classes are
# kvblocks.values' own. `python -m mypy.stubtest kvblocks._native` checks this stub
# against the built module.
"""


def render_stub(ref: ModuleType, hand_written: str) -> str:
    names = sorted(ref.__all__)
    annotations = Annotations(set(names))
    annotations.imports["typing"] = {"final"}
    annotations.imports["typing_extensions"] = {"Self", "disjoint_base"}
    blocks = []
    for name in names:
        obj = getattr(ref, name)
        if shared(obj):
            # Re-exported as itself: `from kvblocks.values import X as X`.
            annotations.aliases[(SHARED, name)] = name
        elif isinstance(obj, type):
            blocks.append("\n".join(class_stub(obj, annotations)))
    functions = [
        "\n".join(function_stub(getattr(ref, name), annotations))
        for name in names
        if not isinstance(getattr(ref, name), type)
    ]
    body = "\n\n".join(blocks) + "\n\n" + "\n".join(functions)
    all_lines = "\n".join(f'    "{name}",' for name in names)
    return (
        f"{STUB_HEADER}\n"
        + "\n".join(annotations.import_lines())
        + f"\n\n__all__ = [\n{all_lines}\n]\n\n{body}\n\n{hand_written}"
    )


def stub_hand_written() -> str:
    text = STUB.read_text(encoding="utf-8")
    start = text.find(STUB_HAND_WRITTEN)
    if start < 0:
        raise LookupError(f"{STUB} has no line starting {STUB_HAND_WRITTEN!r}")
    return text[start:]


# ---------------------------------------------------------------------------- Rust signatures

BINDING = REPO / "rust" / "kvblocks-py" / "src"
#: Rust defaults that stand for a Python value (`convert/mod.rs`, `convert/choice.rs`).
RUST_DEFAULTS: dict[str, object] = {
    "true": True,
    "false": False,
    "None": None,
    "Flag::TRUE": True,
    "Flag::FALSE": False,
    "ChoiceArg::default(Mode::Vllm)": "vllm",
    "ChoiceArg::default(Policy::Fail)": "fail",
}
#: A Rust default the binding applies in code: the Python default is not written there.
GIVEN_ABSENT = "Given::Absent"
#: A parameter as ``(name, keyword_only, default)``; ``default`` is ``NO_DEFAULT``,
#: ``GIVEN_ABSENT`` or the Python value.
Param = tuple[str, bool, object]
NO_DEFAULT = "<required>"


def split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, each part stripped, empties dropped."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += char in "([{<"
        depth -= char in ")]}>"
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def bracketed(text: str, open_at: int) -> str:
    """The text inside the parenthesis that opens at ``text[open_at]``."""
    depth = 0
    for index in range(open_at, len(text)):
        depth += text[index] == "("
        depth -= text[index] == ")"
        if depth == 0:
            return text[open_at + 1 : index]
    raise ValueError(f"unbalanced parenthesis at {text[open_at : open_at + 40]!r}")


def rust_default(expr: str) -> object:
    if expr == GIVEN_ABSENT:
        return GIVEN_ABSENT
    if expr in RUST_DEFAULTS:
        return RUST_DEFAULTS[expr]
    return ast.literal_eval(expr)


def pyo3_params(attrs: str, fn_args: str) -> list[Param]:
    """The Python parameters of a binding function: its ``signature = (...)``, or else its
    Rust arguments but the receiver and ``Python``."""
    at = attrs.find("signature = (")
    if at >= 0:
        entries = split_top_level(bracketed(attrs, attrs.index("(", at)))
    else:
        entries = []
        for arg in split_top_level(fn_args):
            name, _, rust_type = (part.strip() for part in arg.partition(":"))
            if name not in ("self", "&self", "&mut self", "slf") and "Python<" not in rust_type:
                entries.append(name)
    params: list[Param] = []
    keyword_only = False
    for entry in entries:
        if entry == "*":
            keyword_only = True
            continue
        name, _, default = (part.strip() for part in entry.partition("="))
        params.append((name, keyword_only, rust_default(default) if default else NO_DEFAULT))
    return params


def rust_signatures() -> dict[str, list[Param]]:
    """The Python parameters of each binding item documented by ``docstring!``: the
    ``#[new]`` of a class, a method, a function."""
    found: dict[str, list[Param]] = {}
    item = re.compile(r"(?:pub(?:\(crate\))? )?fn \w+(?:<[^>]*>)?\(")
    for path in sorted(BINDING.rglob("*.rs")):
        text = path.read_text(encoding="utf-8")
        for impl in re.finditer(r"#\[pymethods\]\s*impl (\w+) \{", text):
            cls = class_of_struct(text, impl.group(1))
            new = text.find("#[new]", impl.end())
            next_impl = text.find("#[pymethods]", impl.end())
            if cls is not None and new >= 0 and (next_impl < 0 or new < next_impl):
                fn = item.search(text, new)
                assert fn is not None
                found[cls] = pyo3_params(text[new : fn.start()], bracketed(text, fn.end() - 1))
        for doc in re.finditer(r"#\[doc = docstring!\(([\w.]+)\)\]", text):
            fn = item.search(text, doc.end())
            if fn is None:
                continue
            attrs = text[doc.end() : fn.start()]
            if re.search(r"\bstruct\b|#\[(getter|setter|classattr)", attrs):
                continue
            found[doc.group(1)] = pyo3_params(attrs, bracketed(text, fn.end() - 1))
    return found


def class_of_struct(text: str, struct: str) -> str | None:
    """The Python name of a ``#[pyclass(name = "...")]`` struct defined in ``text``."""
    match = re.search(
        r'#\[pyclass\([^]]*name = "(\w+)"[^]]*\)\]\s*(?:#\[[^]]*\]\s*)*pub struct '
        + struct
        + r"\b",
        text,
    )
    return match.group(1) if match else None


def reference_params(obj: Any) -> list[Param]:
    params = list(inspect.signature(obj).parameters.values())
    if not isinstance(obj, type) and params and params[0].name == "self":
        params = params[1:]
    return [
        (
            p.name,
            p.kind is p.KEYWORD_ONLY,
            NO_DEFAULT if p.default is p.empty else p.default,
        )
        for p in params
    ]


def signature_mismatches(ref: ModuleType) -> list[str]:
    """Where a binding item's Python parameters differ from the reference's."""
    rust = rust_signatures()
    problems = []
    for item in api_items(ref):
        if not item.signed:
            continue
        if item.key not in rust:
            problems.append(f"{item.key}: no binding item documented by docstring!({item.key})")
            continue
        want, have = reference_params(item.obj), rust[item.key]
        agree = len(want) == len(have) and all(
            w[:2] == h[:2] and (w[2] == h[2] or (h[2] == GIVEN_ABSENT and w[2] != NO_DEFAULT))
            for w, h in zip(want, have, strict=True)
        )
        if not agree:
            problems.append(f"{item.key}: the reference has {want}, the binding {have}")
    return problems


# ---------------------------------------------------------------------------- main


def rendered() -> dict[Path, str]:
    """What each generated file should hold."""
    ref = reference()
    return {DOCSTRINGS_RS: render_docstrings(ref), STUB: render_stub(ref, stub_hand_written())}


def stale(files: dict[Path, str]) -> list[str]:
    """A unified diff for each file whose contents differ from what it should hold."""
    diffs = []
    for path, text in files.items():
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            name = str(path.relative_to(REPO))
            diffs.append(
                "".join(
                    difflib.unified_diff(
                        current.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        f"{name} (committed)",
                        f"{name} (from kvblocks.reference)",
                    )
                )
            )
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a copy is stale")
    args = parser.parse_args(argv)
    files = rendered()
    if args.check:
        diffs = stale(files)
        for diff in diffs:
            print(diff)
        if diffs:
            print("stale: run `python tools/api_copies.py`", file=sys.stderr)
        mismatches = signature_mismatches(reference())
        for mismatch in mismatches:
            print(mismatch)
        return 1 if diffs or mismatches else 0
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
