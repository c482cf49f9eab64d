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
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
from collections.abc import Callable

__all__ = ["KNOWN_WRAPPERS", "function_definition", "normalized_source", "signature_and_body"]

#: ``(file suffix, function name)`` of the wrappers that call the wrapped function unchanged.
KNOWN_WRAPPERS = frozenset({("transformers/modeling_layers.py", "forward_with_checkpointing")})


def _is_known_wrapper(function: Callable) -> bool:
    code = getattr(function, "__code__", None)
    return code is not None and any(
        code.co_filename.replace("\\", "/").endswith(suffix) and code.co_name == name
        for suffix, name in KNOWN_WRAPPERS
    )


@functools.cache
def _definition(function: Callable) -> ast.FunctionDef | None:
    if hasattr(function, "__wrapped__") and not (
        _is_known_wrapper(function) and not hasattr(function.__wrapped__, "__wrapped__")
    ):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef) or definition.decorator_list:
        return None
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        definition.body = body[1:] or [ast.Pass()]
    return definition


def function_definition(function: Callable) -> ast.FunctionDef | None:
    """``function``'s definition (a copy: callers may edit it), docstring dropped; None where its source
    cannot be read, has a decorator, or ``function`` is a wrapper other than :data:`KNOWN_WRAPPERS`."""
    definition = _definition(function)
    return None if definition is None else copy.deepcopy(definition)


@functools.cache
def normalized_source(function: Callable) -> str | None:
    """The whole ``def``, without docstring, comments and annotations (None as :func:`function_definition`)."""
    definition = function_definition(function)
    if definition is None:
        return None
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
def signature_and_body(function: Callable) -> tuple[str, str] | None:
    """``(arguments, body)``: the arguments as written (annotations kept) and one statement a line."""
    definition = function_definition(function)
    if definition is None:
        return None
    return ast.unparse(definition.args), "\n".join(ast.unparse(statement) for statement in definition.body)
