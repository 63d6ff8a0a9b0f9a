"""Path options of the console commands refuse an empty value.

``Path("")`` is ``Path(".")``, so ``fedroute export --out "$OUT"`` with ``$OUT`` unset (the shell passes
``--out ""``) used to write into the current folder, and ``--log "$LOG"`` read from it. Typer builds a
:class:`click.Path` for every option typed ``Path`` (or ``Path | None``); the command classes here wrap
each such type in :class:`NonEmptyPath`, which refuses an empty or blank value while the command line is
parsed (click's ``Invalid value for '--out': ...``, exit status 2) and hands any other value to the
wrapped type, so its own checks (``exists=``, ``file_okay=``, ``dir_okay=``) and its ``PATH`` metavar stay.

Used as ``typer.Typer(cls=PathCheckedGroup)`` (the group wraps its commands and sub-groups, recursively)
and ``app.command(cls=PathCheckedCommand)`` for a single-command app. Imports click and typer only.
"""

from __future__ import annotations

import os
from typing import Any

import click
import typer.core


class NonEmptyPath(click.ParamType):
    """A :class:`click.Path` (``inner``) that refuses ``""`` and whitespace-only values.

    ``convert`` raises :class:`click.BadParameter` (click prints ``Invalid value for '--opt': the path
    is empty ...`` and exits 2) for an empty or blank value; otherwise it returns
    ``inner.convert(value, param, ctx)``. Other attributes (``name``, ``exists``, ``dir_okay``, the
    metavar, shell completion, the envvar splitter) are the inner type's.
    """

    def __init__(self, inner: click.Path) -> None:
        self.inner = inner
        self.name = inner.name
        self.envvar_list_splitter = inner.envvar_list_splitter

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, (str, bytes, os.PathLike)):
            raw = os.fspath(value)
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if not text.strip():
                self.fail(f"the path is empty ({text!r}); is the shell variable that should hold it unset? "
                          "Give a path (. for the current folder)", param, ctx)
        return self.inner.convert(value, param, ctx)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str | None:
        return self.inner.get_metavar(param, ctx)

    def get_missing_message(self, param: click.Parameter, ctx: click.Context | None = None) -> str | None:
        return self.inner.get_missing_message(param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
        return self.inner.shell_complete(ctx, param, incomplete)

    def to_info_dict(self) -> dict[str, Any]:
        return self.inner.to_info_dict()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"NonEmptyPath({self.inner!r})"


def wrap_path_params(command: click.Command) -> click.Command:
    """Wrap the :class:`click.Path` type of every parameter of ``command`` in :class:`NonEmptyPath`,
    and, for a :class:`click.Group`, those of its sub-commands and sub-groups, recursively. Changes the
    parameters in place; wrapping twice is a no-op. Returns ``command``."""
    for param in command.params:
        if isinstance(param.type, click.Path):
            param.type = NonEmptyPath(param.type)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            wrap_path_params(sub)
    return command


class PathCheckedGroup(typer.core.TyperGroup):
    """A Typer group (``typer.Typer(cls=PathCheckedGroup)``) whose commands, sub-groups and own options
    refuse empty paths (:func:`wrap_path_params`): wrapped when the group is built, when a command is
    added and when one is looked up."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        wrap_path_params(self)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        super().add_command(wrap_path_params(cmd), name)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        return wrap_path_params(command) if command is not None else None


class PathCheckedCommand(typer.core.TyperCommand):
    """A Typer command (``app.command(cls=PathCheckedCommand)``) whose path options refuse empty values
    (:func:`wrap_path_params`)."""

    def __init__(self, name: str | None, **attrs: Any) -> None:
        super().__init__(name, **attrs)
        wrap_path_params(self)
