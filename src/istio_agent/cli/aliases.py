"""Command aliases as istioctl has them (``ps``, ``pc``, ``clusters``, ``c``...), for scripts written for it."""

from __future__ import annotations

import click


class AliasedGroup(click.Group):
    """A click group whose commands also answer to other names; the help lists each command once."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.aliases: dict[str, str] = {}

    def add(self, command: click.Command, *aliases: str) -> None:
        """Add ``command``, which ``aliases`` run too."""
        self.add_command(command)
        self.add_aliases(command.name or "", *aliases)

    def add_aliases(self, name: str, *aliases: str) -> None:
        """``aliases`` run the command ``name``."""
        for alias in aliases:
            self.aliases[alias] = name

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, self.aliases.get(cmd_name, cmd_name))
