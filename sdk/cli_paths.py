"""Path options of the console commands refuse an empty value (``Path("")`` is ``Path(".")``: ``--out "$OUT"``
with ``$OUT`` unset would write into the current folder).

A ``click.Path`` type does not serve every typer release (up to 0.25 a click type, 0.26-0.28 a vendored
click's, from 0.29 none), so the check sits on what they share: the command function's annotations say
which parameters are ``Path`` (or ``Path | None``), and each such parameter's ``process_value(ctx, value)``
sees the raw string first; the error is ``typer.BadParameter`` (exit status 2). Use
``typer.Typer(cls=PathCheckedGroup)`` or ``app.command(cls=PathCheckedCommand)``.
"""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path
from typing import Any, Callable

import typer.core

EMPTY_PATH = ("the path is empty ({!r}); is the shell variable that should hold it unset? "
              "Give a path (. for the current folder)")


def path_parameter_names(callback: Callable[..., Any] | None) -> set[str]:
    """Names of the parameters of ``callback`` (a command's function, or typer's wrapper of it)
    annotated ``Path`` or a union holding ``Path`` (``Path | None``); empty for ``None``."""
    if callback is None:
        return set()
    hints = typing.get_type_hints(inspect.unwrap(callback))
    return {name for name, hint in hints.items()
            if hint is Path or (typing.get_origin(hint) in (typing.Union, types.UnionType) and Path in typing.get_args(hint))}


def refuses_empty(param: Any) -> bool:
    """Whether :func:`wrap_path_params` has wrapped ``param`` (a click or typer parameter)."""
    return getattr(param.process_value, "refuses_empty_path", False)


def _refuse_empty(param: Any) -> None:
    convert = param.process_value

    def process_value(ctx: Any, value: Any) -> Any:
        if isinstance(value, (str, bytes)):
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if not text.strip():
                raise typer.BadParameter(EMPTY_PATH.format(text), ctx=ctx, param=param)
        return convert(ctx, value)

    setattr(process_value, "refuses_empty_path", True)
    param.process_value = process_value


def wrap_path_params(command: Any) -> Any:
    """Make every ``Path`` parameter of ``command`` (a click or typer command) refuse ``""`` and
    whitespace-only values (``typer.BadParameter``: exit status 2), and, for a group, those of its
    sub-commands and sub-groups, recursively. Changes the parameters in place; wrapping twice is a
    no-op. Returns ``command``."""
    names = path_parameter_names(command.callback)
    for param in command.params:
        if param.name in names and not refuses_empty(param):
            _refuse_empty(param)
    for sub in getattr(command, "commands", {}).values():
        wrap_path_params(sub)
    return command


class PathCheckedGroup(typer.core.TyperGroup):
    """A Typer group (``typer.Typer(cls=PathCheckedGroup)``) whose commands, sub-groups and own options
    refuse empty paths (:func:`wrap_path_params`): wrapped when the group is built, when a command is
    added and when one is looked up."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        wrap_path_params(self)

    def add_command(self, cmd: Any, name: str | None = None) -> None:
        super().add_command(wrap_path_params(cmd), name)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        return wrap_path_params(command) if command is not None else None


class PathCheckedCommand(typer.core.TyperCommand):
    """A Typer command (``app.command(cls=PathCheckedCommand)``) whose path options refuse empty values
    (:func:`wrap_path_params`)."""

    def __init__(self, name: str | None, **attrs: Any) -> None:
        super().__init__(name, **attrs)
        wrap_path_params(self)
