"""A session's history, and the standalone script it exports (``%mlxdist export``).

(Not ``export.py``: ``mlx_nbdist.export`` is the function that exports the current
session.) Pure: no session, no MLX. The session keeps an ordered list of :class:`Entry` since
its last (re)start (:meth:`mlx_nbdist.session.Session.record`): every ``%%mlxdist``
cell it ran, and every notebook command that ran on the ranks, as

* a :attr:`EntryKind.CELL`: the cell's source and the ranks it ran on;
* a :attr:`EntryKind.COMMAND`: a command that changed the ranks' state, as the
  in-cell Python that does the same (``%mlxdist shard model --sharding megatron``
  is ``model = mlx_nbdist.shard(model, "megatron", segments=1)``);
  ``%mlxdist load model DIR`` (or ``mlx_nbdist.load_checkpoint("model", DIR)``) is
  ``mlx_nbdist.script.load_checkpoint(model, DIR)``, and a save is
  ``mlx_nbdist.script.save_checkpoint(...)``: every rank of the script loads or
  saves its own slices, by the same code the notebook drives;
* a :attr:`EntryKind.NOTE`: a command that only looked (``show``, ``plan``,
  ``check``...) or a ``%%local`` cell: a comment in the script.

:func:`render` turns that list into the script. Inside a cell, IPython-only syntax
becomes plain Python (:func:`plain_python`):

* line magics: ``%time stmt`` runs ``stmt``; ``!cmd`` is
  ``mlx_nbdist.script.system("cmd")`` and ``x = !cmd`` is ``x =
  mlx_nbdist.script.getoutput("cmd")`` (IPython's ``{var}`` expansion is not done);
  every other magic (``%timeit``, ``%matplotlib``, ``x?``...) becomes a comment;
* a ``%%time`` or ``%%capture`` cell runs its body; another cell magic is commented out;
* the cell's last bare expression, which Jupyter shows, becomes ``display(expr)``;
  the script's ``display`` (:func:`mlx_nbdist.script.display`) prints the object's
  text form as Jupyter's ``text/plain`` would and, like the notebook for a last
  expression, prints nothing for ``None``; a trailing ``;`` keeps it silent;
* a cell run on some ranks only (``--ranks 0,2``) runs under ``if rank in (0, 2):``;
* a cell that failed on a rank is kept as a comment (its partial effects are not
  replayed): the script runs what the notebook ran successfully.
"""

from __future__ import annotations

import ast
import datetime as _dt
import io
import json
import os
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .enums import TextEnum
from .errors import MLXDistError

__all__ = [
    "Entry",
    "EntryKind",
    "ExportError",
    "cell_entry",
    "load_entry",
    "note_entry",
    "plain_python",
    "render",
    "save_entry",
    "shard_entry",
    "target",
    "write",
]


class ExportError(MLXDistError):
    """A session cannot be exported (nothing ran yet, the file exists, ...)."""


class EntryKind(TextEnum):
    """What one entry of a session's history is."""

    CELL = "cell"
    COMMAND = "command"
    NOTE = "note"


@dataclass(frozen=True)
class Entry:
    """One step of a session's history, in the order it ran.

    Attributes:
        kind: see :class:`EntryKind`.
        code: a cell's source; a command's in-cell Python; a note's code, if any
            (shown commented out, e.g. a ``%%local`` cell's).
        label: a cell's name (``In [7]``); a command's or note's notebook line.
        ranks: the ranks a cell ran on, ``None`` for every rank.
        failed: why a cell failed (``"rank 1: ValueError: ..."``), ``""`` when it
            ran on every rank it was sent to.
        comment: a note's advice (what to do in the script instead).
    """

    kind: EntryKind
    code: str = ""
    label: str = ""
    ranks: tuple[int, ...] | None = None
    failed: str = ""
    comment: str = ""


def cell_entry(code: str, name: str, ranks: list[int] | None = None, n: int | None = None,
               failed: str = "") -> Entry:
    """A ``%%mlxdist`` cell; ``ranks`` covering all ``n`` ranks is stored as ``None``."""
    subset = None if ranks is None or (n is not None and sorted(ranks) == list(range(n))) \
        else tuple(sorted(ranks))
    return Entry(EntryKind.CELL, code, name, subset, failed)


def shard_entry(model: str, sharding: str | dict[str, str | None], segments: int = 1) -> Entry:
    """``%mlxdist shard MODEL --sharding S --segments K`` (or ``mlx_nbdist.shard(name)``)."""
    text = sharding if isinstance(sharding, str) else json.dumps(sharding)
    line = f"%mlxdist shard {model} --sharding {_quote(text)} --segments {segments}"
    code = f"{model} = mlx_nbdist.shard({model}, {sharding!r}, segments={segments})"
    return Entry(EntryKind.COMMAND, code, line)


def load_entry(model: str, directory: str, optimizer: str | None = None) -> Entry:
    """``%mlxdist load MODEL DIR`` (or ``mlx_nbdist.load_checkpoint``): in the script,
    every rank loads its slices with :func:`mlx_nbdist.script.load_checkpoint`."""
    opt = f" --optimizer {optimizer}" if optimizer else ""
    code = (f"mlx_nbdist.script.load_checkpoint({model}, {directory!r}"
            + (f", optimizer={optimizer})" if optimizer else ")"))
    return Entry(EntryKind.COMMAND, code, f"%mlxdist load {model} {_quote(directory)}{opt}")


def save_entry(model: str, directory: str, optimizer: str | None = None, *,
               overwrite: bool = False, tokenizer_from: str | None = None) -> Entry:
    """``%mlxdist save MODEL DIR`` (or ``mlx_nbdist.save``): in the script, every rank
    writes its slices with :func:`mlx_nbdist.script.save_checkpoint` (rank 0 the index),
    under the notebook's name for the model."""
    line = f"%mlxdist save {model} {_quote(directory)}"
    args = [model, repr(directory)]
    if optimizer:
        line += f" --optimizer {optimizer}"
        args.append(f"optimizer={optimizer}")
    args.append(f"name={model!r}")
    if overwrite:
        line += " --overwrite"
        args.append("overwrite=True")
    if tokenizer_from:
        line += f" --tokenizer-from {_quote(tokenizer_from)}"
        args.append(f"tokenizer_from={tokenizer_from!r}")
    return Entry(EntryKind.COMMAND, f"mlx_nbdist.script.save_checkpoint({', '.join(args)})",
                 line)


def note_entry(line: str, code: str = "", comment: str = "") -> Entry:
    """A notebook-only command or ``%%local`` cell: a comment in the script."""
    return Entry(EntryKind.NOTE, code, line, comment=comment)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


# ----------------------------------------------------------------- the whole script


def render(entries: list[Entry], n: int, backend: str, *, session_id: str = "",
           version: str = "", name: str = "script.py", now: _dt.datetime | None = None
           ) -> str:
    """The script of ``entries`` for a session of ``n`` ranks on ``backend``; ``name``
    is the file's name, for the header's command lines.

    Raises:
        ExportError: no cell or state-changing command ran on the ranks.
    """
    if not any(e.kind in (EntryKind.CELL, EntryKind.COMMAND) for e in entries):
        raise ExportError(
            "nothing to export: this session has run no %%mlxdist cell on its ranks since "
            "it (re)started; run the cells first, then export")
    when = (now or _dt.datetime.now(_dt.UTC)).isoformat(timespec="seconds")
    backend = str(backend)
    out = [_header(n, backend, session_id, version, when, name)]
    for e in entries:
        out.append(_section(e))
    return "\n".join(out).rstrip() + "\n"


def target(path: str | os.PathLike[str]) -> Path:
    """Where a script asked for as ``path`` goes (``.py`` added when there is no suffix)."""
    p = Path(path).expanduser()
    return p if p.suffix else p.with_suffix(".py")


def write(text: str, path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Write the script to :func:`target` of ``path``; returns its absolute path.

    Raises:
        ExportError: the file exists and ``overwrite`` is false; its folder is missing.
    """
    p = target(path)
    if p.is_dir():
        raise ExportError(f"export: {p} is a folder; give a file name such as {p / 'train.py'}")
    if p.exists() and not overwrite:
        raise ExportError(f"export: {p} exists; pass --overwrite (overwrite=True) to replace it")
    if not p.parent.is_dir():
        raise ExportError(f"export: the folder {p.parent} does not exist")
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    tmp.replace(p)
    return p.absolute()


def _header(n: int, backend: str, session_id: str, version: str, when: str, name: str) -> str:
    src = f" from session {session_id}" if session_id else ""
    ver = f" {version}" if version else ""
    return f'''#!/usr/bin/env python3
"""Exported by mlx_nbdist{ver}{src} on {when}.

The cells a session of {n} ranks ({backend} backend) ran on its ranks, in order, since
its last (re)start. Run it with either:

    mlx.launch -n {n} --backend {backend} -- python {name}
    python -m mlx_nbdist run -n {n} --backend {backend} {name}

Notebook-only commands are comments; a cell's last expression is display()ed.
"""
# mlx_nbdist export: n={n} backend={backend}
import mlx.core as mx
import mlx.nn as nn

import mlx_nbdist
import mlx_nbdist.script
from mlx_nbdist.script import display

# joins the group mlx.launch (or mlx_nbdist run) started; refuses another size
world, rank, size = mlx_nbdist.script.init(backend={backend!r}, size={n})
'''


def _rule(title: str) -> str:
    title = title.replace("\n", " ")
    return f"# --- {title} " + "-" * max(3, 74 - len(title))


def _section(e: Entry) -> str:
    if e.kind == EntryKind.COMMAND:
        return f"{_rule(e.label)}\n{e.code.rstrip()}\n"
    if e.kind == EntryKind.NOTE:
        lines = [f"# {e.label}  (notebook only: not run here)"]
        if e.comment:
            lines += textwrap.wrap(e.comment, 86, initial_indent="#   ",
                                   subsequent_indent="#   ", break_long_words=False)
        lines += [f"#   {line}".rstrip() for line in e.code.rstrip().splitlines()]
        return "\n".join(lines) + "\n"
    title = e.label or "cell"
    if e.ranks is not None:
        title += f" (ranks {', '.join(map(str, e.ranks))})"
    if e.failed:
        body = [f"# {title} failed ({e.failed}); not exported. Its code was:"]
        body += [f"#   {line}".rstrip() for line in e.code.rstrip().splitlines()]
        return "\n".join(body) + "\n"
    code = plain_python(e.code)
    if not code.strip():
        code = "pass\n"
    if e.ranks is not None:
        code = f"if rank in {e.ranks!r}:\n" + _indent(code)
    return f"{_rule(title)}\n{code.rstrip()}\n"


# ---------------------------------------------------------- one cell as plain Python


#: line magics whose argument is run as it is (they only time it)
_RUN_ARGUMENT = {"time"}
#: cell magics whose body is run as it is
_RUN_BODY = {"time", "capture"}


def plain_python(code: str) -> str:
    """An IPython cell's source as plain Python that runs the same outside IPython
    (see the module docstring for each rule). A cell that does not parse even after
    IPython's transforms is returned commented out, with the parser's message."""
    from IPython.core.inputtransformer2 import TransformerManager

    text = TransformerManager().transform_cell(code)
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        lines = [f"# not exported: this cell does not parse ({e.msg}, line {e.lineno}):"]
        return "\n".join(lines + [f"#   {line}".rstrip() for line in code.splitlines()]) + "\n"
    if len(tree.body) == 1 and (cell := _cell_magic(tree.body[0])) is not None:
        name, line, body = cell
        if name in _RUN_BODY:
            return f"# %%{name} {line}".rstrip() + "\n" + plain_python(body)
        kept = [f"# %%{name} {line}  (notebook only: not run here)".rstrip()]
        return "\n".join(kept + [f"#   {x}".rstrip() for x in body.splitlines()]) + "\n"
    lines = text.splitlines()
    edits: dict[int, tuple[int, list[str]]] = {}  # first line -> (last line, new lines)
    silent = _silent_statements(tree)
    for stmt in _statements(tree):
        new = _replace(stmt, lines)
        if new is None:
            continue
        indent = lines[stmt.lineno - 1][: stmt.col_offset]
        if stmt in silent:
            new = [*new, "pass"]
        edits[stmt.lineno] = (stmt.end_lineno or stmt.lineno, [indent + x for x in new])
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr) and last.lineno not in edits and not _quiet(last, lines):
        edits[last.lineno] = (last.end_lineno or last.lineno, _display(last, lines))
    out: list[str] = []
    i = 0
    while i < len(lines):
        if i + 1 in edits:
            end, new = edits[i + 1]
            out += new
            i = end
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out).rstrip() + "\n"


def _ipython_call(node: ast.AST) -> tuple[str, list[str]] | None:
    """``get_ipython().METHOD('a', 'b')`` -> ``("METHOD", ["a", "b"])``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    owner = node.func.value
    if not (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
            and owner.func.id == "get_ipython" and not owner.args):
        return None
    args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if len(args) != len(node.args) or node.keywords:
        return None
    return node.func.attr, args


def _cell_magic(stmt: ast.stmt) -> tuple[str, str, str] | None:
    if isinstance(stmt, ast.Expr):
        got = _ipython_call(stmt.value)
        if got and got[0] == "run_cell_magic" and len(got[1]) == 3:
            return got[1][0], got[1][1], got[1][2]
    return None


def _statements(tree: ast.Module) -> list[ast.stmt]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.stmt)]


def _replace(stmt: ast.stmt, lines: list[str]) -> list[str] | None:
    """The lines (without indentation) that replace a statement made of a magic or
    shell escape, or ``None`` to keep it."""
    target = ""
    value: ast.AST | None = None
    if isinstance(stmt, ast.Expr):
        value = stmt.value
    elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        value = stmt.value
        target = ast.get_source_segment("\n".join(lines), stmt.targets[0]) or ""
    got = _ipython_call(value) if value is not None else None
    if got is None:
        return None
    method, args = got
    lhs = f"{target} = " if target else ""
    if method == "system" and args:
        return [f"{lhs}mlx_nbdist.script.system({args[0]!r})"]
    if method == "getoutput" and args:
        return [f"{lhs}mlx_nbdist.script.getoutput({args[0]!r})"]
    if method == "run_line_magic" and len(args) == 2:
        name, arg = args
        if name in _RUN_ARGUMENT and arg.strip() and _parses(arg):
            return [f"{lhs}{arg.strip()}  # was: %{name}"]
        what = f"%{name} {arg}".rstrip()
        if name in ("pinfo", "pinfo2"):
            what = f"{arg}{'?' if name == 'pinfo' else '??'}"
        return [f"# {what}  (notebook only: not run here)"] + (
            [f"{target} = None"] if target else [])
    if method == "run_cell_magic" and len(args) == 3:
        body = [f"#   {x}".rstrip() for x in args[2].splitlines()]
        return [f"# %%{args[0]} {args[1]}  (notebook only: not run here)".rstrip(), *body]
    return [f"# get_ipython().{method}(...)  (notebook only: not run here)"] + (
        [f"{target} = None"] if target else [])


def _silent_statements(tree: ast.Module) -> set[ast.stmt]:
    """Statements that become comments only and are the last of a block made only of
    such statements: each needs a ``pass`` so the block stays valid."""
    out: set[ast.stmt] = set()
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if node is tree or not isinstance(block, list) or not block:
                continue
            if not all(isinstance(s, ast.stmt) for s in block):
                continue
            if all(_comment_only(s) for s in block):
                out.add(block[-1])
    return out


def _comment_only(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Expr) and (got := _ipython_call(stmt.value)) is not None:
        method, args = got
        if method in ("system", "getoutput"):
            return False
        return not (method == "run_line_magic" and len(args) == 2 and args[0] in _RUN_ARGUMENT
                    and args[1].strip() and _parses(args[1]))
    return False


def _parses(code: str) -> bool:
    try:
        ast.parse(code.strip())
    except SyntaxError:
        return False
    return True


def _quiet(stmt: ast.Expr, lines: list[str]) -> bool:
    """A last expression Jupyter does not show: ``x;`` and ``display(...)``-like calls
    that return ``None`` are left as they are (``display(display(x))`` would print twice)."""
    value = stmt.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in (
            "display", "print"):
        return True
    end = stmt.end_lineno or stmt.lineno
    rest = lines[end - 1][stmt.end_col_offset or 0:]
    return rest.split("#", 1)[0].strip().startswith(";")


def _display(stmt: ast.Expr, lines: list[str]) -> list[str]:
    """The last expression's lines, wrapped in ``display(...)``."""
    first, last = stmt.lineno - 1, (stmt.end_lineno or stmt.lineno) - 1
    c0, c1 = stmt.col_offset, stmt.end_col_offset or len(lines[last])
    if first == last:
        line = lines[first]
        return [f"{line[:c0]}display({line[c0:c1]}){line[c1:]}"]
    head = lines[first][:c0] + "display(" + lines[first][c0:]
    tail = lines[last][:c1] + ")" + lines[last][c1:]
    return [head, *lines[first + 1:last], tail]


def _indent(code: str, prefix: str = "    ") -> str:
    """Indent ``code`` one level, leaving the inside of multi-line strings as it is."""
    inside = _string_continuations(code)
    out = []
    for i, line in enumerate(code.splitlines(), start=1):
        out.append(line if i in inside or not line.strip() else prefix + line)
    return "\n".join(out) + "\n"


def _string_continuations(code: str) -> set[int]:
    """Line numbers (1-based) that continue a string token begun on an earlier line."""
    lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING or _is_fstring_part(tok):
                lines.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    return lines


def _is_fstring_part(tok: Any) -> bool:
    return tokenize.tok_name.get(tok.type, "") in ("FSTRING_MIDDLE", "FSTRING_END")
