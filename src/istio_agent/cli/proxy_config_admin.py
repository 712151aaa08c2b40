"""``agentctl proxy-config`` subcommands that act on Envoy's admin API (registered by :func:`register`).

``log`` reads and sets Envoy's logger levels, ``rootca-compare`` compares two Envoys' ROOTCA, as
istioctl 1.28 does for pods (``istioctl/pkg/proxyconfig/proxyconfig.go``); here the targets are
admin addresses. See docs/proxy-config-admin.md.
"""

from __future__ import annotations

import click

from istio_agent.cli import runtime
from istio_agent.cli.aliases import AliasedGroup
from istio_agent.ctl.configdump.source import DEFAULT_ADMIN

LEVEL_HELP = (
    "Comma-separated minimum per-logger level of messages to output, in the form of "
    "[<logger>:]<level>,[<logger>:]<level>,... or <level> to change all active loggers, where logger "
    'components can be listed by running "agentctl proxy-config log ADMIN_ADDRESS", and level can be '
    "one of [trace, debug, info, warning, error, critical, off]"
)


def register(group: AliasedGroup) -> None:
    """Add this module's commands to the ``proxy-config`` group, with istioctl's aliases."""
    group.add(log_command, "o")
    group.add(rootca_compare_command, "rc")


@click.command("log")
@click.argument("address", default=DEFAULT_ADMIN, required=False, metavar="[ADMIN_ADDRESS]")
@click.option("--level", default="", help=LEVEL_HELP)
@click.option("-r", "--reset", is_flag=True, help="Reset levels to default value (warning).")
@click.option(
    "-o", "--output", default="short", show_default=True, help="istioctl's shared flag: only short applies"
)
@click.option(
    "--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0.1), help="seconds per request"
)
def log_command(address: str, level: str, reset: bool, output: str, timeout: float) -> None:
    """Envoy's logging levels at ADMIN_ADDRESS (its admin HOST:PORT, default 127.0.0.1:15000), updated optionally.

    \b
      agentctl proxy-config log 127.0.0.1:15000                       # list
      agentctl proxy-config log 127.0.0.1:15000 --level debug         # every logger
      agentctl proxy-config log 127.0.0.1:15000 --level http:debug,redis:debug
      agentctl proxy-config log 127.0.0.1:15000 -r                    # every logger to warning
    """
    from istio_agent.ctl.envoylog import LogLevelError, LogQuery, run

    query = LogQuery(address, level, reset, output, timeout)
    try:
        runtime.run(run(query, lambda text: click.echo(text, nl=False)))
    except LogLevelError as err:
        raise click.ClickException(str(err)) from None


@click.command("rootca-compare")
@click.argument("addresses", nargs=-1, metavar="ADMIN_A ADMIN_B")
@click.option(
    "--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0.1), help="seconds per request"
)
def rootca_compare_command(addresses: tuple[str, ...], timeout: float) -> None:
    """Compare the ROOTCA of the Envoys at two admin addresses (each HOST:PORT).

    A shared root certificate is reported (on stderr, as istioctl); none is an error (exit status 1).
    """
    from istio_agent.ctl.rootca import RootCAError, compare

    if len(addresses) != 2:
        raise click.ClickException("rootca-compare requires 2 pods as an argument")
    try:
        report = runtime.run(compare(addresses[0], addresses[1], timeout))
    except RootCAError as err:
        raise click.ClickException(str(err)) from None
    click.echo(report, err=True)
