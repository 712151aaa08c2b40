"""``agentctl proxy-config`` config-dump views: all, bootstrap, cluster, listener, route, endpoint, ecds.

Names, aliases, flags and output are istioctl 1.28's (``istioctl/pkg/proxyconfig/proxyconfig.go``);
the target is an Envoy admin address (default 127.0.0.1:15000) or ``-f FILE`` (``-`` for stdin)
instead of a pod. See docs/proxy-config.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from istio_agent.cli.aliases import AliasedGroup

OUTPUT = click.Choice(["short", "json", "yaml"])


F = TypeVar("F", bound=Callable[..., Any])


class GoBoolOption(click.Option):
    """A Go bool flag (pflag): bare it is true; a value only as ``--name=VALUE``, one of
    ``strconv.ParseBool``'s; the word after a bare flag stays a positional argument. Parsed by
    :class:`GoFlagCommand`, which hands click the normalised ``--name=true|false``."""


class GoFlagCommand(click.Command):
    """A command whose :class:`GoBoolOption` flags parse as pflag's bool flags."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        names = {
            name
            for param in self.params
            if isinstance(param, GoBoolOption)
            for name in param.opts
            if name.startswith("--")
        }
        normalised: list[str] = []
        for index, arg in enumerate(args):
            if arg == "--":
                normalised += args[index:]
                break
            flag, equals, value = arg.partition("=")
            if flag in names:
                arg = f"{flag}={str(_go_bool(flag, value) if equals else True).lower()}"
            normalised.append(arg)
        return super().parse_args(ctx, normalised)


def _go_bool(flag: str, text: str) -> bool:
    """``strconv.ParseBool`` exactly (no spaces), with pflag's error."""
    from istio_agent.config.env import parse_go_bool

    try:
        if text != text.strip():  # parse_go_bool strips; Go does not
            raise ValueError(text)
        return parse_go_bool(text)
    except ValueError:
        raise click.BadOptionUsage(
            flag,
            f'invalid argument "{text}" for "{flag}" flag: strconv.ParseBool: parsing "{text}": invalid syntax',
        ) from None


def _verbose() -> Callable[[F], F]:
    """istioctl's ``--verbose`` (a Go bool flag, on by default): ``--verbose``, ``--verbose=false``."""

    def attach(command: F) -> F:
        option = click.option(
            "--verbose",
            "verbose",
            cls=GoBoolOption,
            type=click.BOOL,
            default=True,
            show_default=True,
            help="Output more information (--verbose=false for less)",
        )
        return option(command)

    return attach


def _source(target: str | None, file: str | None, timeout: float) -> Any:
    from istio_agent.ctl.configdump.source import DEFAULT_ADMIN, Source

    if target is not None and file is not None:
        raise click.UsageError("give either an admin address or -f FILE, not both")
    return Source(target or DEFAULT_ADMIN, file, timeout)


def _run(
    view: str, target: str | None, file: str | None, timeout: float, render: Callable[[bytes], str]
) -> None:
    from istio_agent.cli import runtime
    from istio_agent.ctl.configdump.source import ConfigDumpError, read_bytes

    try:
        data = runtime.run(read_bytes(_source(target, file, timeout), view))
        click.echo(render(data), nl=False)
    except ConfigDumpError as err:
        click.echo(getattr(err, "printed", ""), nl=False)  # what istioctl wrote before failing
        raise click.ClickException(str(err)) from None
    except RecursionError:  # what reading stopped short of, printing met
        raise click.ClickException("the document is nested too deeply to print") from None


def _common(function: Callable[..., None]) -> Callable[..., None]:
    function = click.option(
        "--timeout",
        default=5.0,
        show_default=True,
        type=click.FloatRange(min=0.1),
        help="seconds per request",
    )(function)
    function = click.option("-f", "--file", "file", help="Envoy config dump JSON file ('-' for stdin)")(
        function
    )
    return click.argument("target", required=False)(function)


def _output(default: str = "short") -> Callable[[Callable[..., None]], Callable[..., None]]:
    return click.option(
        "-o",
        "--output",
        type=OUTPUT,
        default=default,
        show_default=True,
        help="Output format: one of json|yaml|short",
    )


def _dump(data: bytes) -> Any:
    from istio_agent.ctl.configdump.source import Dump

    return Dump.from_bytes(data)


def _formats(output: str, short: Callable[[], str], as_json: Callable[[], str]) -> str:
    from istio_agent.ctl.configdump import render

    if output == "short":
        return short()
    text = as_json()
    return render.json_to_yaml(text.rstrip("\n")) + "\n" if output == "yaml" else text


@click.command("cluster")
@_common
@_output()
@click.option("--fqdn", default="", help="Filter clusters by substring of Service FQDN field")
@click.option("--direction", default="", help="Filter clusters by Direction field")
@click.option("--subset", default="", help="Filter clusters by substring of Subset field")
@click.option("--port", default=0, type=int, help="Filter clusters by Port field")
def cluster(
    target: str | None,
    file: str | None,
    timeout: float,
    output: str,
    fqdn: str,
    direction: str,
    subset: str,
    port: int,
) -> None:
    """Envoy's clusters from TARGET (admin HOST:PORT, default 127.0.0.1:15000) or -f FILE."""
    from istio_agent.ctl.configdump import clusters

    chosen = clusters.ClusterFilter(fqdn, port, subset, direction)

    def render(data: bytes) -> str:
        dump = _dump(data)
        return _formats(
            output, lambda: clusters.summary(dump, chosen), lambda: clusters.dump_json(dump, chosen)
        )

    _run("cluster", target, file, timeout, render)


@click.command("listener", cls=GoFlagCommand)
@_common
@_output()
@click.option("--address", default="", help="Filter listeners by address field")
@click.option("--type", "kind", default="", help="Filter listeners by type field")
@click.option("--port", default=0, type=int, help="Filter listeners by Port field")
@_verbose()
def listener(
    target: str | None,
    file: str | None,
    timeout: float,
    output: str,
    address: str,
    kind: str,
    port: int,
    verbose: bool,
) -> None:
    """Envoy's listeners from TARGET (admin HOST:PORT, default 127.0.0.1:15000) or -f FILE."""
    from istio_agent.ctl.configdump import listeners

    chosen = listeners.ListenerFilter(address, port, kind, verbose)

    def render(data: bytes) -> str:
        dump = _dump(data)
        return _formats(
            output, lambda: listeners.summary(dump, chosen), lambda: listeners.dump_json(dump, chosen)
        )

    _run("listener", target, file, timeout, render)


@click.command("route", cls=GoFlagCommand)
@_common
@_output()
@click.option("--name", default="", help="Filter listeners by route name field")
@_verbose()
def route(
    target: str | None, file: str | None, timeout: float, output: str, name: str, verbose: bool
) -> None:
    """Envoy's route configurations from TARGET (admin HOST:PORT) or -f FILE."""
    from istio_agent.ctl.configdump import routes

    chosen = routes.RouteFilter(name, verbose)

    def render(data: bytes) -> str:
        dump = _dump(data)
        return _formats(output, lambda: routes.summary(dump, chosen), lambda: routes.dump_json(dump, chosen))

    _run("route", target, file, timeout, render)


def _endpoint_options(function: Callable[..., None]) -> Callable[..., None]:
    for option in (
        click.option("--status", default="", help="Filter endpoints by status field"),
        click.option("--cluster", "cluster_name", default="", help="Filter endpoints by cluster name field"),
        click.option("--port", default=0, type=int, help="Filter endpoints by Port field"),
        click.option("--address", default="", help="Filter endpoints by address field"),
    ):
        function = option(function)
    return function


@click.command("endpoint")
@_common
@_output()
@_endpoint_options
def endpoint(
    target: str | None,
    file: str | None,
    timeout: float,
    output: str,
    address: str,
    port: int,
    cluster_name: str,
    status: str,
) -> None:
    """Envoy's endpoints (its /clusters?format=json) from TARGET (admin HOST:PORT) or -f FILE."""
    from istio_agent.ctl.configdump import endpoints

    chosen = endpoints.EndpointFilter(address, port, cluster_name, status)

    def render(data: bytes) -> str:
        statuses = endpoints.read_clusters(data)
        return _formats(
            output,
            lambda: endpoints.hosts_summary(statuses, chosen),
            lambda: endpoints.hosts_json(statuses, chosen),
        )

    _run("endpoint", target, file, timeout, render)


@click.command("eds", hidden=True)
@_common
@_output()
@_endpoint_options
def eds(
    target: str | None,
    file: str | None,
    timeout: float,
    output: str,
    address: str,
    port: int,
    cluster_name: str,
    status: str,
) -> None:
    """The endpoints of a config dump with EDS (config_dump?include_eds=true), as istioctl's hidden eds."""
    from istio_agent.ctl.configdump import endpoints

    chosen = endpoints.EndpointFilter(address, port, cluster_name, status)

    def render(data: bytes) -> str:
        dump = _dump(data)
        return _formats(
            output, lambda: endpoints.eds_summary(dump, chosen), lambda: endpoints.eds_json(dump, chosen)
        )

    _run("eds", target, file, timeout, render)


@click.command("bootstrap")
@_common
@_output("json")
def bootstrap(target: str | None, file: str | None, timeout: float, output: str) -> None:
    """Envoy's bootstrap from TARGET (admin HOST:PORT) or -f FILE; short prints the versions."""
    from istio_agent.ctl.configdump import extensions

    def render(data: bytes) -> str:
        dump = _dump(data)
        if output == "short":
            return extensions.bootstrap_summary(dump)
        return extensions.bootstrap_output(dump, output)

    _run("bootstrap", target, file, timeout, render)


@click.command("ecds")
@_common
@_output()
def ecds(target: str | None, file: str | None, timeout: float, output: str) -> None:
    """Envoy's typed extension configurations (ECDS) from TARGET (admin HOST:PORT) or -f FILE."""
    from istio_agent.ctl.configdump import extensions

    def render(data: bytes) -> str:
        dump = _dump(data)
        if output == "short":
            return extensions.ecds_summary(dump)
        return extensions.ecds_output(dump, output)

    _run("ecds", target, file, timeout, render)


@click.command("all", cls=GoFlagCommand)
@_common
@_output()
@_verbose()
@click.option("--fqdn", default="", help="Filter clusters by substring of Service FQDN field")
@click.option("--direction", default="", help="Filter clusters by Direction field")
@click.option("--subset", default="", help="Filter clusters by substring of Subset field")
@click.option("--port", default=0, type=int, help="Filter clusters and listeners by Port field")
@click.option("--address", default="", help="Filter listeners by address field")
@click.option("--type", "kind", default="", help="Filter listeners by type field")
@click.option("--name", default="", help="Filter routes by route name field")
def all_config(
    target: str | None,
    file: str | None,
    timeout: float,
    output: str,
    verbose: bool,
    fqdn: str,
    direction: str,
    subset: str,
    port: int,
    address: str,
    kind: str,
    name: str,
) -> None:
    """Every table from TARGET's config dump (with EDS); json|yaml print the dump itself."""
    from istio_agent.ctl.configdump import clusters, endpoints, full, listeners, render, routes
    from istio_agent.ctl.configdump.source import ConfigDumpError

    def show(data: bytes) -> str:
        if output == "json":
            return data.decode("utf-8", "replace") + "\n"
        if output == "yaml":
            if not data.strip():
                return "null\n\n"  # JSONToYAML reads nothing as YAML's null
            try:
                return render.json_to_yaml(data.decode("utf-8", "replace")) + "\n"
            except ValueError as err:
                raise ConfigDumpError(f"error converting JSON to YAML: {err}") from None
        return full.summary(
            _dump(data),
            clusters.ClusterFilter(fqdn, port, subset, direction),
            listeners.ListenerFilter(address, port, kind, verbose),
            routes.RouteFilter(name, verbose),
            endpoints.EndpointFilter(address, port),
        )

    _run("all", target, file, timeout, show)


def register(group: AliasedGroup) -> None:
    """Add this module's commands to the ``proxy-config`` group, with istioctl's aliases."""
    group.add(all_config, "a")
    group.add(bootstrap, "b")
    group.add(cluster, "clusters", "c")
    group.add(listener, "listeners", "l")
    group.add(route, "routes", "r")
    group.add(endpoint, "endpoints", "ep")
    group.add(eds)
    group.add(ecds, "ec")
