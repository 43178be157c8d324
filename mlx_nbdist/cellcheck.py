"""Checks of a cell's source in the notebook, before any rank runs it.

Top-level ``await`` (and ``async for``/``async with`` outside a function): IPython
runs such a cell as a coroutine, and an ipyparallel engine (ipyparallel 9.2 with
ipykernel 7.4, measured) never finishes it: the cell would wait for its deadline and
leave the group broken. It is refused with the line to change.
"""

from __future__ import annotations

import ast

_ASYNC = (ast.Await, ast.AsyncFor, ast.AsyncWith)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def top_level_await(code: str) -> int | None:
    """The line of the first ``await``, ``async for`` or ``async with`` outside any
    function in ``code`` (IPython syntax: magics, ``!cmd``), or ``None``; code that
    does not parse is left to the ranks, which report it."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        tree = ast.parse(TransformerManager().transform_cell(code))
    except (SyntaxError, ValueError):
        return None
    todo: list[ast.AST] = [tree]
    found: list[int] = []
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _SCOPES):
                continue
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
