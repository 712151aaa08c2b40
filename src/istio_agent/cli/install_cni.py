"""``install-cni``: the istio-cni node agent (Istio's ``cni/cmd/install-cni``): flags and env in, then run.

Flags are Istio's, each also read from its environment variable (``--cni-conf-name`` or
``CNI_CONF_NAME``); see docs/cni.md. SIGTERM or SIGINT ends the watch loop, the install is cleaned
up (our entry out of the CNI config, the kubeconfig and the plugin binary removed) and the process
exits 0. A failed install pass exits 1, as Istio's does, so kubelet restarts the pod. The repair
controller (``cni/repair``), when a repair mode is set, runs beside the installer until then.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from istio_agent import __version__
from istio_agent.cli import runtime
from istio_agent.config.env import ConfigError

EXIT_ERROR = 1
PLUGIN_LOG_SCOPE = "cni-plugin"
"""The log scope whose level install-cni hands to the plugin (``--log_output_level cni-plugin:debug``)."""


def _fail(message: str) -> NoReturn:
    click.echo(f"Error: {message}", err=True)
    sys.exit(EXIT_ERROR)


def _with_settings_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every Istio flag as a click option taking text (None when not given: then the env var applies)."""
    from istio_agent.cni.install.settings import FLAGS

    for option in reversed(FLAGS):
        if option.kind == "bool":
            # cobra: a bare --flag means true, --flag=false sets false.
            decorator = click.option(f"--{option.flag}", default=None, is_flag=False, flag_value="true")
        else:
            decorator = click.option(f"--{option.flag}", default=None, type=str)
        command = decorator(command)
    return command


def _plugin_log_level(output_levels: str) -> str:
    """The plugin's level: the ``cni-plugin`` scope's in ``--log_output_level`` (info when not given)."""
    from istio_agent.log import parse_output_levels

    level = parse_output_levels(output_levels).get(PLUGIN_LOG_SCOPE, logging.INFO)
    names = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn", logging.ERROR: "error"}
    return names.get(level, "fatal" if level == logging.CRITICAL else "none")


@click.command(context_settings={"ignore_unknown_options": False})
@click.option(
    "--log_output_level", default="default:info", help="scope:level,... (debug|info|warn|error|none)"
)
@click.option("--log_as_json", is_flag=True, help="JSON log lines")
@_with_settings_flags
def main(log_output_level: str, log_as_json: bool, **flags: str | None) -> None:
    """Install the istio-cni plugin on this node and keep it installed (Istio's install-cni)."""
    from istio_agent.cni.install.settings import load_settings
    from istio_agent.log import configure, scope

    given = {name.replace("_", "-"): value for name, value in flags.items()}
    try:
        settings = load_settings(given, plugin_log_level=_plugin_log_level(log_output_level))
    except (ConfigError, ValueError) as err:  # ValueError: a bad --log_output_level
        _fail(str(err))
    # Process-wide changes only once the command line is known good.
    runtime.prepare_process()
    configure(log_output_level, log_as_json, stream=sys.stdout)
    scope("cni-agent").info("install-cni %s starting", __version__)
    sys.exit(runtime.run(serve(settings)))


async def serve(settings: Any) -> int:
    """Run the servers and the installer until a signal (exit 0, cleaned up) or a failed pass (exit 1)."""
    from istio_agent.cni.install.installer import Installer, InstallError
    from istio_agent.cni.install.instance import InstanceLock
    from istio_agent.cni.install.servers import health_endpoint, metrics_endpoint
    from istio_agent.cni.repair.controller import RepairSetupError
    from istio_agent.cni.repair.controller import build as build_repair
    from istio_agent.log import scope
    from istio_agent.metrics import Registry

    log = scope("cni-agent")
    stop = runtime.install_signal_handlers()
    registry = Registry(prefix="istio_")
    installer = Installer(settings, registry)
    try:
        repair = build_repair(settings, registry)
    except RepairSetupError as err:  # Istio's StartRepair: fatal
        log.error("%s", err)
        return EXIT_ERROR
    endpoints = [health_endpoint("", settings.health_port, lambda: (installer.ready, installer.reason))]
    if settings.monitoring_port > 0:
        endpoints.append(metrics_endpoint("", settings.monitoring_port, registry))
    instance = InstanceLock(settings.cni_agent_run_dir)
    try:
        instance.acquire()  # before anything is installed: a second instance must touch nothing
    except OSError as err:
        log.error("%s", err)
        return EXIT_ERROR
    code = 0
    started = []
    repairing: asyncio.Task[None] | None = None
    try:
        for endpoint in endpoints:
            await endpoint.start()
            started.append(endpoint)
        work = asyncio.create_task(installer.run())
        stopping = asyncio.create_task(stop.wait())
        if repair is not None:
            repairing = asyncio.create_task(repair.run(), name="repair-controller")
        await asyncio.wait({work, stopping, *filter(None, [repairing])}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if repairing is not None and repairing.done():  # it runs until cancelled: this is a bug
            log.error("the repair controller stopped", exc_info=repairing.exception())
            code = EXIT_ERROR
        if work.done():
            error = work.exception()
            if isinstance(error, InstallError):
                log.error("installation failed: %s", error)
                code = EXIT_ERROR
            elif error is not None:
                raise error
        else:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    except OSError as err:
        log.error("%s", err)
        code = EXIT_ERROR
    finally:
        if repairing is not None:
            repairing.cancel()
            await asyncio.gather(repairing, return_exceptions=True)
        installer.cleanup()
        for endpoint in started:
            await endpoint.stop()
        instance.release()
    log.info("install-cni exiting")
    return code
