"""Go-style flags (spf13/pflag, as cobra parses Istio's commands) on argparse.

pilot-agent's command lines are written for Istio's Go binary: ``--flag=value`` and ``--flag value``,
``-f value``, ``-fvalue``, ``-f=value``, short boolean clusters (``-nk eth1``), booleans that take a
value only after ``=`` (``--dry-run=false``), a value that may start with ``-``, no abbreviations,
and, where a command whitelists unknown flags (``pilot-agent proxy``), an unknown flag skipped with
the value after it. argparse alone does not read these the same way, so a short pass first rewrites
each flag to one ``--name=value`` argument (and the positionals after ``--``); argparse then stores
the values with their defaults and writes the help. Click is not used: it costs the agent 1.7 MB
resident (issue 23).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from istio_agent.config.env import parse_go_bool

Value = str | bool | tuple[str, ...] | None


class FlagError(Exception):
    """A command line the flags cannot read; the message says why (the caller exits 255 with it)."""


@dataclass(frozen=True)
class Flag:
    """One flag: its long name as typed (Go's spelling, e.g. ``meshConfig``) and optional short name.

    ``help=None`` hides it from the help (flags accepted for Istio's command lines, unused here).
    A boolean's value is None when not given; ``repeated`` collects every occurrence in order.
    """

    name: str
    short: str = ""
    default: Value = None
    help: str | None = ""
    boolean: bool = False
    repeated: bool = False


@dataclass
class Parsed:
    """The flags' values by long name, the positional arguments, and whether help was asked for."""

    values: dict[str, Value]
    args: list[str] = field(default_factory=list)
    help: bool = False

    def __getitem__(self, name: str) -> Value:
        return self.values[name]

    def text(self, name: str) -> str | None:
        """A value flag's string (None when it has no default and was not given)."""
        value = self.values[name]
        assert value is None or isinstance(value, str), name
        return value

    def boolean(self, name: str) -> bool | None:
        """A boolean flag's value (None when not given)."""
        value = self.values[name]
        assert value is None or isinstance(value, bool), name
        return value


class _Parser(argparse.ArgumentParser):
    """Raises instead of printing usage and exiting 2: callers report errors as Istio does."""

    def error(self, message: str) -> NoReturn:
        raise FlagError(message)


def _help_width() -> int:
    """The terminal's width less 2, as argparse takes it, without the ``shutil`` argparse would load.

    argparse makes a formatter for every flag it adds (to check the metavar), and its default width
    comes from ``shutil.get_terminal_size``: every pilot-agent would keep shutil, bz2 and lzma. This
    reads the same sources in the same order: ``COLUMNS``, the terminal of stdout, else 80.
    """
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return (columns or 80) - 2


class _Help(argparse.HelpFormatter):
    """Flags as pflag prints them: ``-n, --dry-run`` for booleans, ``--domain string`` for values."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=40, width=_help_width())

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Descriptions keep their paragraphs (argparse would join them into one)."""
        return "\n\n".join(super(_Help, self)._fill_text(part, width, indent) for part in text.split("\n\n"))

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        names = ", ".join(action.option_strings)
        return names if action.nargs == 0 or action.metavar == "" else f"{names} {action.metavar}"


class FlagSet:
    """One command's flags: parses its arguments and writes its help."""

    def __init__(self, prog: str, description: str, flags: Sequence[Flag], usage: str = "[flags]") -> None:
        self.prog = prog
        self.description = description
        self.flags = tuple(flags)
        self.usage = f"{prog} {usage}"
        self._long = {flag.name: flag for flag in self.flags}
        self._short = {flag.short: flag for flag in self.flags if flag.short}

    def parse(self, argv: Sequence[str], *, tolerant: bool = False) -> Parsed:
        """Read ``argv``; unknown flags are skipped when ``tolerant``, else a FlagError."""
        tokens: list[str] = []
        args: list[str] = []
        asked_help = False
        for item in _Scanner(self, list(argv), tolerant):
            if item is None:
                asked_help = True
            elif isinstance(item, tuple):
                flag, value = item
                tokens.append(f"--{flag.name}={value}")
            else:
                args.append(item)
        namespace = self._parser().parse_args([*tokens, "--", *args] if args else tokens)
        values: dict[str, Value] = {}
        for flag in self.flags:
            value = getattr(namespace, _dest(flag))
            if flag.boolean and isinstance(value, str):
                values[flag.name] = _go_bool(flag, value)
            elif flag.repeated:
                values[flag.name] = flag.default if value is None else tuple(value)  # given values replace it
            else:
                values[flag.name] = value
        return Parsed(values, list(namespace.args), asked_help)

    def help(self) -> str:
        return self._parser().format_help()

    def _parser(self) -> _Parser:
        parser = _Parser(
            prog=self.prog,
            usage=self.usage,
            description=self.description,
            add_help=False,
            allow_abbrev=False,
            formatter_class=_Help,
        )
        parser.add_argument("-h", "--help", nargs=0, action=_NoOp, help=f"help for {self.prog.split()[-1]}")
        for flag in self.flags:
            names = [f"--{flag.name}", *([f"-{flag.short}"] if flag.short else [])]
            names.sort(key=len)
            shown = argparse.SUPPRESS if flag.help is None else flag.help
            if flag.boolean:
                parser.add_argument(*names, dest=_dest(flag), default=flag.default, help=shown, metavar="")
            elif flag.repeated:
                parser.add_argument(
                    *names, dest=_dest(flag), action="append", default=None, help=shown, metavar="stringArray"
                )
            else:
                parser.add_argument(
                    *names, dest=_dest(flag), default=flag.default, help=shown, metavar="string"
                )
        parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
        return parser


class _NoOp(argparse.Action):
    """``--help`` is seen by the scanner; argparse only lists it."""

    def __call__(self, *_: object, **__: object) -> None:
        return None


def _dest(flag: Flag) -> str:
    return "flag_" + flag.name.replace("-", "_")


def _go_bool(flag: Flag, text: str) -> bool:
    try:
        return parse_go_bool(text)
    except ValueError as err:
        raise FlagError(f"invalid value for --{flag.name}: {err}") from None


class _Scanner:
    """Walks the arguments as pflag does, yielding (flag, value) pairs, positionals, and None for help."""

    def __init__(self, flags: FlagSet, argv: list[str], tolerant: bool) -> None:
        self._flags = flags
        self._argv = argv
        self._tolerant = tolerant
        self._at = 0

    def _next_value(self, shown: str) -> str:
        if self._at >= len(self._argv):
            raise FlagError(f"Option '{shown}' requires an argument.")
        value = self._argv[self._at]
        self._at += 1
        return value

    def _skip_unknown(self, shown: str, has_value: bool) -> None:
        """pflag's whitelist skips ``--x value`` whole, but not a following flag."""
        if not self._tolerant:
            raise FlagError(f"No such option '{shown}'.")
        if not has_value and self._at < len(self._argv) and not self._argv[self._at].startswith("-"):
            self._at += 1

    def __iter__(self) -> Iterator[tuple[Flag, str] | str | None]:
        while self._at < len(self._argv):
            arg = self._argv[self._at]
            self._at += 1
            if arg == "--":
                yield from self._argv[self._at :]
                return
            if arg.startswith("--"):
                yield from self._long(arg)
            elif arg.startswith("-") and len(arg) > 1:
                yield from self._shorts(arg)
            else:
                yield arg

    def _long(self, arg: str) -> Iterator[tuple[Flag, str] | None]:
        name, equals, value = arg[2:].partition("=")
        if name == "help":
            yield None
            return
        flag = self._flags._long.get(name)
        if flag is None:
            self._skip_unknown(f"--{name}", bool(equals))
        elif flag.boolean:
            yield flag, value if equals else "true"
        else:
            yield flag, value if equals else self._next_value(f"--{name}")

    def _shorts(self, arg: str) -> Iterator[tuple[Flag, str] | None]:
        rest = arg[1:]
        while rest:
            letter, rest = rest[0], rest[1:]
            if letter == "h":
                yield None
                continue
            flag = self._flags._short.get(letter)
            if flag is None:
                self._skip_unknown(f"-{letter}", bool(rest))
                return
            if flag.boolean:
                if rest.startswith("="):
                    yield flag, rest[1:]
                    return
                yield flag, "true"
            else:
                yield flag, rest.removeprefix("=") if rest else self._next_value(f"-{letter}")
                return
