"""Checks of a cell's source in the notebook, before any rank runs it.

Top-level ``await`` (and ``async for``/``async with`` outside a function): IPython
runs such a cell as a coroutine, and an ipyparallel engine (ipyparallel 9.2 with
ipykernel 7.4, measured) never finishes it: the cell would wait for its deadline and
leave the group broken. It is refused with the line to change.
"""

from __future__ import annotations

import ast
import inspect

_ASYNC = (ast.Await, ast.AsyncFor, ast.AsyncWith)


def top_level_await(code: str) -> int | None:
    """The line of the first ``await``, ``async for`` or ``async with`` that makes
    ``code`` (IPython syntax: magics, ``!cmd``) a coroutine, as IPython decides it
    (Python compiles it with top-level await allowed, a coroutine results), or
    ``None``; code that does not compile is left to the ranks, which report it."""
    # every cell goes through here, and transforming and compiling a cell of 200 lines
    # takes 12 ms: a coroutine needs one of these words
    if "await" not in code and "async" not in code:
        return None
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(code)
        compiled = compile(source, "<cell>", "exec", dont_inherit=True,
                           flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except (SyntaxError, ValueError):
        return None
    if not compiled.co_flags & inspect.CO_COROUTINE:
        return None
    return _first_outside_functions(ast.parse(source)) or 1


def _first_outside_functions(tree: ast.AST) -> int | None:
    """The first line with an await outside a function's or class's body (their
    decorators, defaults and bases run in the cell's own scope)."""
    found: list[int] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            children: list[ast.AST] = [*node.decorator_list, node.args]
            children += [node.returns] if node.returns else []
        elif isinstance(node, ast.Lambda):
            children = [node.args]
        elif isinstance(node, ast.ClassDef):
            children = [*node.decorator_list, *node.bases, *node.keywords]
        else:
            children = list(ast.iter_child_nodes(node))
        for child in children:
            if isinstance(child, _ASYNC) or (
                isinstance(child, ast.comprehension) and child.is_async
            ):
                found.append(getattr(child, "lineno", None) or getattr(node, "lineno", 1))
            todo.append(child)
    return min(found) if found else None


def refuse_top_level_await(code: str) -> None:
    """Raise ``ValueError`` naming the line when ``code`` awaits outside a function."""
    line = top_level_await(code)
    if line is not None:
        raise ValueError(
            f"line {line} of the cell uses await (or async for/with) outside a function: "
            "ranks never finish a cell run as a coroutine (ipyparallel engines), and "
            "asyncio.run() fails there (an event loop runs). Run the coroutine in a "
            "thread: concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, "
            "main()).result()"
        )
