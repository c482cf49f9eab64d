"""Recognising library code by its source: the one reader every "known forward" check uses.

Several rules are exact only for a particular piece of code: the scaled word embeddings of Gemma's and
BART's families (:mod:`~dp_hf.per_example.ghost.support`), the learned position embeddings of OPT and BART
(:mod:`~dp_hf.per_example.positions`), T5's and MPNet's relative biases
(:mod:`~dp_hf.per_example.relative_bias`), Swin's attention (:mod:`~dp_hf.per_example.swin`) and BEiT's layer
scale (:mod:`~dp_hf.per_example.ghost.layer_scale`). Each compares the source text of a method with the
bodies it was written for, so that a changed method is refused, never guessed at.

:func:`function_definition` reads that source: ``inspect.getsource`` parsed, its docstring dropped. What
runs must be what was read, so a function with a decorator in its source is not read (the decorator's
wrapper would run instead), and neither is a wrapper (``__wrapped__``), with one exception:
transformers' ``GradientCheckpointingLayer`` wraps every layer's ``forward`` in
``forward_with_checkpointing``, which calls the layer's own ``forward`` unchanged unless gradient
checkpointing is on (refused under DP). :func:`normalized_source` and :func:`signature_and_body` are the
two spellings the known bodies are stored in.

The same text runs as other code where the names in it are bound to other objects, so a text is read only if
the function that runs binds them as the library does (:func:`_runs_as_read`, checked at every read): its
globals and builtins are torch's, transformers' or ``math``'s own modules and objects, its only closure cell is
``super()``'s class, and its defaults are the literals its text writes. An audit found a subclass copying T5's
``compute_bias`` into a module whose ``torch`` counted in steps of 2 recognised, so that dp_hf's per-example copy
of the body ran instead of it (a whole T5: per-example norms 5%, the clipped sum 27% off a loop of single
examples), and MPNet's ``compute_position_bias.__defaults__`` set to 16 buckets recognised while the copy used
the 32 its text writes (the bias's per-example norms 23% off). A text is read again when the function's code
object changes (a ``__code__`` assigned after a first read was still recognised by its cached text), and the
known wrapper must call the function it names in ``__wrapped__`` (``tests/test_positions_bias_audit.py``).
Where ``super()`` leads (the class's MRO) is not the reader's to check: a rule that relies on it checks it.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dis
import functools
import inspect
import sys
import textwrap
import types
from collections.abc import Callable

__all__ = [
    "KNOWN_WRAPPERS",
    "LIBRARY_PACKAGES",
    "function_definition",
    "normalized_source",
    "signature_and_body",
]

#: ``(file suffix, function name)`` of the wrappers that call the wrapped function unchanged.
KNOWN_WRAPPERS = frozenset({("transformers/modeling_layers.py", "forward_with_checkpointing")})


#: Top-level packages whose modules and objects a known text may read from its globals.
LIBRARY_PACKAGES = frozenset({"torch", "transformers", "math"})

_MISSING = object()


def _is_known_wrapper(function: Callable) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and any(
        code.co_filename.replace("\\", "/").endswith(suffix) and code.co_name == name
        for suffix, name in KNOWN_WRAPPERS
    )


def _read_target(function: Callable) -> Callable | None:
    """The function whose text is read, which is the one that runs: ``function`` itself, or the function the
    known wrapper calls (its closure's ``forward``, which must be its ``__wrapped__``); None for other wrappers."""
    if not hasattr(function, "__wrapped__"):
        return function if isinstance(function, types.FunctionType) else None
    if not isinstance(function, types.FunctionType) or not _is_known_wrapper(function):
        return None
    wrapped = function.__wrapped__
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    called = cells.get("forward")
    if called is None or hasattr(wrapped, "__wrapped__") or not isinstance(wrapped, types.FunctionType):
        return None
    try:
        return wrapped if called.cell_contents is wrapped else None
    except ValueError:  # an empty cell
        return None


@functools.cache
def _parse(target: types.FunctionType, code: types.CodeType) -> ast.FunctionDef | None:
    """``target``'s definition as its source reads while its code object is ``code`` (a new code: read again)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(target)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef) or definition.decorator_list:
        return None
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        definition.body = body[1:] or [ast.Pass()]
    return definition


@functools.cache
def _global_names(code: types.CodeType) -> frozenset[str] | None:
    """The global (or builtin) names ``code`` and the code nested in it read; None if it writes a global."""
    names: set[str] = set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            return None
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(instruction.argval)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            nested = _global_names(constant)
            if nested is None:
                return None
            names |= nested
    return frozenset(names)


def _library_object(value: object) -> bool:
    """A module of a library package, as imported (in ``sys.modules``), or an object defined in one."""
    if isinstance(value, types.ModuleType):
        return sys.modules.get(value.__name__) is value and value.__name__.split(".")[0] in LIBRARY_PACKAGES
    module = getattr(value, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in LIBRARY_PACKAGES


@functools.cache
def _literal_defaults(target: types.FunctionType, code: types.CodeType) -> tuple[tuple, dict] | None:
    """The defaults ``target``'s text writes, ``(positional, keyword-only)``; None if one is not a literal."""
    arguments = _parse(target, code).args
    try:
        positional = tuple(ast.literal_eval(d) for d in arguments.defaults)
        keyword = {
            a.arg: ast.literal_eval(d)
            for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)
            if d is not None
        }
    except ValueError:
        return None
    return positional, keyword


def _same_values(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b))


def _runs_as_read(target: types.FunctionType) -> bool:
    """Whether ``target`` binds the names of its text as the library does (module docstring)."""
    code = target.__code__
    if any(name != "__class__" for name in code.co_freevars):
        return False
    for cell in target.__closure__ or ():  # super()'s class only
        try:
            if not isinstance(cell.cell_contents, type):
                return False
        except ValueError:  # an empty cell
            return False
    defaults = _literal_defaults(target, code)
    if defaults is None:
        return False
    positional, keyword = defaults
    kwdefaults = target.__kwdefaults__ or {}
    names = sorted(keyword)
    if sorted(kwdefaults) != names or not _same_values(target.__defaults__ or (), positional):
        return False
    if not _same_values(tuple(kwdefaults[k] for k in names), tuple(keyword[k] for k in names)):
        return False
    read_globals = _global_names(code)
    if read_globals is None:
        return False
    namespace, builtin_names = target.__globals__, getattr(target, "__builtins__", builtins.__dict__)
    for name in read_globals:
        value = namespace.get(name, _MISSING)
        if value is _MISSING:  # a builtin: the interpreter's own
            if builtin_names.get(name, _MISSING) is not getattr(builtins, name, _MISSING):
                return False
        elif not _library_object(value):
            return False
    return True


def _definition(function: Callable) -> tuple[types.FunctionType, ast.FunctionDef] | None:
    """``(target, definition)``: what runs and its text (not a copy), or None (:func:`function_definition`)."""
    target = _read_target(function)
    if target is None:
        return None
    definition = _parse(target, target.__code__)
    if definition is None or not _runs_as_read(target):
        return None
    return target, definition


def function_definition(function: Callable) -> ast.FunctionDef | None:
    """``function``'s definition (a copy: callers may edit it), docstring dropped; None where its source
    cannot be read, has a decorator, ``function`` is a wrapper other than :data:`KNOWN_WRAPPERS`, or it does not
    run as read (other globals, closure cells or defaults: :func:`_runs_as_read`)."""
    read = _definition(function)
    return None if read is None else copy.deepcopy(read[1])


def normalized_source(function: Callable) -> str | None:
    """The whole ``def``, without docstring, comments and annotations (None as :func:`function_definition`)."""
    read = _definition(function)
    return None if read is None else _normalized(read[0], read[0].__code__)


def signature_and_body(function: Callable) -> tuple[str, str] | None:
    """``(arguments, body)``: the arguments as written (annotations kept) and one statement a line."""
    read = _definition(function)
    return None if read is None else _signature_and_body(read[0], read[0].__code__)


@functools.cache
def _normalized(target: types.FunctionType, code: types.CodeType) -> str:
    definition = copy.deepcopy(_parse(target, code))
    definition.returns = None
    arguments = definition.args
    for argument in (
        *arguments.posonlyargs,
        *arguments.args,
        *arguments.kwonlyargs,
        arguments.vararg,
        arguments.kwarg,
    ):
        if argument is not None:
            argument.annotation = None
    return ast.unparse(definition)


@functools.cache
def _signature_and_body(target: types.FunctionType, code: types.CodeType) -> tuple[str, str]:
    definition = _parse(target, code)
    return ast.unparse(definition.args), "\n".join(ast.unparse(statement) for statement in definition.body)
