"""``pilot-agent``: Istio's workload agent command line (flags, env and exit codes as Istio's)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click

from istio_agent import __version__
from istio_agent.agent import Agent, AgentSettings
from istio_agent.config import ConfigError, Env, ProxyConfig, SecuritySettings, XdsSettings
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.envoy.process import EnvoyStartError
from istio_agent.log import DEFAULT_OUTPUT_LEVELS, configure, scope
from istio_agent.memory import pin_mmap_threshold

log = scope("default")
PROXY_TYPES = ("sidecar", "router", "waypoint", "ztunnel", "agentgateway")
EXIT_ERROR = 255  # Istio exits with os.Exit(-1) on any command error
TOLERANT = {"ignore_unknown_options": True, "allow_extra_args": True}


def run_event_loop(main: object) -> None:
    """Run a coroutine on uvloop when installed (the house rule), else asyncio's loop."""
    try:
        import uvloop

        uvloop.run(main)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]


async def wait_for_signal() -> None:
    """Return on the first SIGINT/SIGTERM; later signals are swallowed, as in Istio."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("received termination signal, shutting down")


@click.group(context_settings=TOLERANT)
@click.option(
    "--log_output_level", default=DEFAULT_OUTPUT_LEVELS, help="scope:level,... (debug|info|warn|error|none)"
)
@click.option("--log_as_json", is_flag=True, help="JSON log lines")
@click.option("--log_target", multiple=True, default=["stdout"], hidden=True)
@click.option("--log_stacktrace_level", default="default:none", hidden=True)
@click.option("--log_caller", default="", hidden=True)
@click.option("--vklog", default="0", hidden=True)
@click.pass_context
def main(ctx: click.Context, log_output_level: str, log_as_json: bool, **_ignored: object) -> None:
    """Istio's workload agent (pilot-agent), in Python."""
    ctx.obj = {"log_output_level": log_output_level, "log_as_json": log_as_json}


@main.command(context_settings=TOLERANT)
@click.argument("proxy_type", default="sidecar", required=False)
@click.option("--meshConfig", "mesh_config", default="./etc/istio/config/mesh", help="mesh config file")
@click.option("--domain", default="", help="DNS domain suffix (default <POD_NAMESPACE>.svc.cluster.local)")
@click.option("--serviceCluster", "service_cluster", default="istio-proxy", hidden=True)
@click.option(
    "--proxyLogLevel", "proxy_log_level", default="warning", help="Envoy log level (and comp:level,...)"
)
@click.option("--proxyComponentLogLevel", "proxy_component_log_level", default="", hidden=True)
@click.option("--concurrency", default=0, type=int, hidden=True)
# Istio's other proxy flags, accepted so the injection template's command line works unchanged.
@click.option("--templateFile", "template_file", default="", hidden=True)
@click.option("--outlierLogPath", "outlier_log_path", default="", hidden=True)
@click.option("--stsPort", "sts_port", default=0, type=int, hidden=True)
@click.option("--tokenManagerPlugin", "token_manager_plugin", default="", hidden=True)
@click.option("--profiling", default=True, type=bool, hidden=True)
# Root flags are persistent in Istio (cobra): they may also follow the subcommand.
@click.option("--log_output_level", "log_output_level", default=None, hidden=True)
@click.option("--log_as_json", "log_as_json", is_flag=True, default=None, hidden=True)
@click.pass_context
def proxy(
    ctx: click.Context,
    proxy_type: str,
    mesh_config: str,
    domain: str,
    proxy_log_level: str,
    proxy_component_log_level: str,
    concurrency: int,
    log_output_level: str | None,
    log_as_json: bool | None,
    **_later: object,
) -> None:
    """Run the agent next to Envoy: SDS, the xDS proxy, and Envoy itself on a generated bootstrap."""
    as_json = bool(log_as_json) or ctx.obj["log_as_json"]
    try:
        configure(log_output_level or ctx.obj["log_output_level"], as_json, stream=sys.stdout)
    except ValueError as err:
        _fail(str(err))
    if proxy_type not in PROXY_TYPES:
        _fail(f"invalid proxy Type: {proxy_type}")
    env = Env()
    workdir = Path.cwd()
    log.info("pilot-agent %s starting (%s) in %s", __version__, proxy_type, workdir)
    try:
        proxy_config = ProxyConfig.load(env, workdir / mesh_config)
        security = SecuritySettings.from_env(env, workdir, proxy_config)
        xds = XdsSettings.from_env(env, security, proxy_config, proxy_type)
        disable_envoy = env.flag("DISABLE_ENVOY")
        bootstrap = None
        if not disable_envoy:
            bootstrap = BootstrapSettings.from_env(
                env,
                workdir=workdir,
                proxy_config=proxy_config,
                security=security,
                proxy_type=proxy_type,
                domain=domain,
                log_level=proxy_log_level,
                component_log_level=proxy_component_log_level,
                concurrency=concurrency,
                log_as_json=as_json,
            )
    except ConfigError as err:
        _fail(str(err))
    settings = AgentSettings(
        security=security,
        proxy_config=proxy_config,
        xds=xds,
        bootstrap=bootstrap,
        serve_sds=not disable_envoy,
    )
    pin_mmap_threshold()  # large xDS pushes must not ratchet resident memory up (see memory.py)
    try:
        run_event_loop(_run_agent(settings))
    except (ConfigError, OSError) as err:  # bad settings, a socket path that cannot be bound, no Envoy
        _fail(str(err))


async def _run_agent(settings: AgentSettings) -> None:
    """Run until SIGINT/SIGTERM or until Envoy exits on its own; both end with exit status 0, as in Istio."""
    agent = Agent(settings)
    try:
        await agent.start()
        signalled = asyncio.ensure_future(wait_for_signal())
        envoy_exit = asyncio.ensure_future(agent.wait_envoy())
        try:
            await asyncio.wait([signalled, envoy_exit], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (signalled, envoy_exit):
                task.cancel()
            await asyncio.gather(signalled, envoy_exit, return_exceptions=True)
    except EnvoyStartError as err:
        raise OSError(f"cannot start Envoy: {err}") from None
    finally:
        await agent.stop()


@main.command()
@click.option("-s", "--short", is_flag=True, help="print only the version")
@click.option("-o", "--output", type=click.Choice(["", "yaml", "json"]), default="")
def version(short: bool, output: str) -> None:
    """Print the version."""
    if short:
        click.echo(__version__)
    elif output == "json":
        click.echo(
            f'{{"clientVersion": {{"version": "{__version__}", "golang_version": "python{sys.version.split()[0]}"}}}}'
        )
    elif output == "yaml":
        click.echo(
            f"clientVersion:\n  version: {__version__}\n  golang_version: python{sys.version.split()[0]}"
        )
    else:
        click.echo(f'version.BuildInfo{{Version:"{__version__}", PythonVersion:"{sys.version.split()[0]}"}}')


def _fail(message: str) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    main()
