"""Supervising the Envoy process: start it, report how it exited, drain and stop it.

As Istio's pkg/envoy/proxy.go and pkg/envoy/agent.go do.

One ``EnvoyProcess`` is one run of Envoy; restarting (beyond Istio, ``ENVOY_RESTART_ON_EXIT``) is
``istio_agent.envoy.supervisor``'s job. On shutdown the agent never sends SIGTERM; it asks Envoy to
drain listeners over the admin API, waits the termination drain period (or, with
EXIT_ON_ZERO_ACTIVE_CONNECTIONS, until no connection is left, bounded by drainDuration) or until
Envoy exits, then sends SIGKILL.

Beyond Istio, Envoy dies with the agent: it is started with a parent-death signal (SIGKILL), so an
agent that is itself SIGKILLed (or crashes) does not leave an Envoy behind holding the workload's
ports, and the next agent started in the same place can bind them (docs/compatibility.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

from istio_agent import goformat
from istio_agent.config.bootstrap import BootstrapSettings
from istio_agent.envoy.admin import AdminError, admin_request
from istio_agent.envoy.binary import envoy_to_run
from istio_agent.log import scope

log = scope("envoy")
DRAIN_REQUEST_TIMEOUT = 5.0
STATS_REQUEST_TIMEOUT = 2.0  # each active-connections poll, as Istio's
ACTIVE_CONNECTIONS_POLL_INTERVAL = 1.0
MAX_STATS_FAILURES = 5  # consecutive failed polls before Envoy is killed anyway
ACTIVE_CONNECTIONS_PATH = "/stats?usedonly&filter=downstream_cx_active$"


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the calling process gets when its parent (thread) dies."""
PARENT_GONE_EXIT = 127
"""The child's exit status when the agent died before Envoy could be executed."""


class EnvoyStartError(OSError):
    """Envoy could not be executed (missing binary, permissions)."""


@functools.cache
def _prctl() -> Callable[[int, int, int, int, int], int]:
    """The C library's prctl(2), typed once so that calling it in a forked child allocates nothing new."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get ``sig`` when this process dies, however it dies.

    Everything is prepared here, before the fork; the child only makes the prctl call and compares
    two process ids, then execs. The kernel sends the signal when the *thread* that forked exits:
    the agent starts Envoy from its event loop, which runs on the main thread for the life of the
    process. If the agent died between the fork and the prctl call, the child has been re-parented
    already and would never get the signal: it exits instead of starting an orphan Envoy.
    """
    prctl, parent, signum = _prctl(), os.getpid(), int(sig)

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(PARENT_GONE_EXIT)

    return in_child


def envoy_command(settings: BootstrapSettings, bootstrap_path: Path) -> list[str]:
    """Envoy's command line, in Istio's exact order (Istio: pkg/envoy/proxy.go)."""
    ipv = "v6" if settings.ipv6_only else "v4"
    command = [
        str(envoy_to_run(settings.binary)),
        "-c", str(bootstrap_path),
        "--drain-time-s", str(int(settings.drain_duration.total_seconds())),
        "--drain-strategy", "immediate",
        "--local-address-ip-version", ipv,
        "--file-flush-interval-msec", str(int(settings.file_flush_interval.total_seconds() * 1000)),
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
    ]  # fmt: skip
    if settings.file_flush_min_size_kb > 0:
        command += ["--file-flush-min-size-kb", str(settings.file_flush_min_size_kb)]
    if settings.log_level:
        command += ["-l", settings.log_level]
    if settings.component_log_level:
        command += ["--component-log-level", settings.component_log_level]
    if settings.skip_deprecated_logs:
        command.append("--skip-deprecated-logs")
    if settings.enable_core_dump:
        command.append("--enable-core-dump")
    if settings.config_yaml:
        command += ["--config-yaml", settings.config_yaml]
    if settings.concurrency > 0:
        command += ["--concurrency", str(settings.concurrency)]
    return command


def active_connections(
    body: str, settings: BootstrapSettings, secure_metrics_ports: Iterable[int] = ()
) -> int:
    """Sum Envoy's ``listener.*.downstream_cx_active`` stats, the way Istio decides a drain is over.

    Only user-traffic listeners count: per-worker lines, Envoy internal listeners, the admin
    listener and Istio's own 15021/15090 (and secure metrics) listeners are skipped, and so are
    malformed lines. An empty body is -1 (Envoy said nothing: treated as "nothing left").
    """
    if not body.strip():
        return -1
    known = {"listener.admin.downstream_cx_active", "listener.admin.main_thread.downstream_cx_active"}
    for port in (settings.envoy_status_port, settings.envoy_prometheus_port, *secure_metrics_ports):
        known.add(f"listener.0.0.0.0_{port}.downstream_cx_active")
    total = 0
    for line in body.splitlines():
        name, sep, value = line.partition(":")
        name = name.strip()
        if not sep or ":" in value or not name.startswith("listener."):
            continue
        if "worker_" in name or name.startswith("listener.envoy_internal_") or name in known:
            continue
        try:
            total += int(value.strip())
        except ValueError:
            continue
    return total


class EnvoyProcess:
    """One Envoy process started on a bootstrap file.

    ``owns_bootstrap``: the file was generated for this run and is deleted once Envoy has exited
    (a user-supplied ``customConfigFile`` is not). ``poll_interval``: the pause between
    active-connection polls during an EXIT_ON_ZERO_ACTIVE_CONNECTIONS drain (tests shorten it).
    """

    def __init__(
        self,
        settings: BootstrapSettings,
        bootstrap_path: Path,
        *,
        owns_bootstrap: bool = True,
        poll_interval: float = ACTIVE_CONNECTIONS_POLL_INTERVAL,
    ) -> None:
        self._settings = settings
        self._bootstrap_path = bootstrap_path
        self._owns_bootstrap = owns_bootstrap
        self._poll_interval = poll_interval
        self._process: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Task[int] | None = None
        self._aborting = False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        return self._process.returncode if self._process else None

    @property
    def exited(self) -> bool:
        """True once Envoy has exited and its exit has been reported."""
        return self._exited is not None and self._exited.done()

    def command(self) -> list[str]:
        return envoy_command(self._settings, self._bootstrap_path)

    async def start(self) -> None:
        """Start Envoy with the agent's environment and stdout/stderr; raise EnvoyStartError if it cannot run."""
        if self._process is not None:
            raise RuntimeError("Envoy was already started")
        command = self.command()
        log.info("Envoy command: %s", command)
        try:
            self._process = await asyncio.create_subprocess_exec(*command, preexec_fn=die_with_parent())
        except OSError as err:
            self._remove_bootstrap()
            raise EnvoyStartError(err.errno, f"failed to start Envoy {command[0]}: {err.strerror}") from None
        self._exited = asyncio.get_running_loop().create_task(self._watch(self._process), name="envoy-exit")

    async def wait(self) -> int:
        """Wait for Envoy to exit (for any reason) and return its exit status (negative: signal)."""
        if self._exited is None:
            raise RuntimeError("Envoy was not started")
        return await asyncio.shield(self._exited)

    async def drain_and_stop(self, graceful_drain: bool = True) -> int:
        """Shut Envoy down as Istio does: drain listeners, wait the termination drain period, SIGKILL.

        ``graceful_drain=False`` (after ``/quitquitquit`` or ``/drain``) kills Envoy at once.
        """
        if self._exited is None:
            raise RuntimeError("Envoy was not started")
        if graceful_drain and not self._exited.done():
            log.info("Agent draining Proxy for termination")
            began = asyncio.get_running_loop().time()
            await self.drain_listeners()
            if self._settings.exit_on_zero_active_connections:
                await self._drain_until_idle(began)
            else:
                await self._drain_period()
        elif not graceful_drain:  # Istio's terminate() after /drain or /quitquitquit (skipDrain)
            log.info("Agent draining Proxy for termination")
            log.info("Agent already drained, exiting immediately")
        await self.kill()
        if self._aborting:
            log.info("Envoy aborted normally")
        return await self.wait()

    async def drain_listeners(self, *, skip_exit: bool = False) -> None:
        """POST ``/drain_listeners?inboundonly&graceful`` (sidecars) or ``?graceful``; errors are only logged.

        ``skip_exit`` (the status server's ``/drain``) keeps Envoy running once the listeners drained.
        """
        query = "inboundonly&graceful" if self._settings.proxy_type == "sidecar" else "graceful"
        if skip_exit:
            query += "&skip_exit"
        target = f"/drain_listeners?{query}"
        try:
            status, body = await self._admin("POST", target, DRAIN_REQUEST_TIMEOUT)
        except AdminError as err:
            log.warning("Envoy drain request to %s%s failed: %s", self._settings.admin_url, target, err)
            return
        if status != 200:
            log.warning("Envoy drain request returned %d: %s", status, body.strip()[:200])

    async def _admin(self, method: str, target: str, timeout: float) -> tuple[int, str]:
        settings = self._settings
        return await admin_request(
            settings.localhost, settings.proxy_admin_port, method, target, timeout=timeout
        )

    async def kill(self) -> None:
        """SIGKILL Envoy (if still running) and wait until it has exited."""
        if self._process is None or self._exited is None:
            return
        if self._process.returncode is None and not self._exited.done():
            self._aborting = True
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
        await self.wait()

    async def _drain_period(self) -> None:
        """Wait terminationDrainDuration, or less if Envoy exits first."""
        assert self._exited is not None
        period = self._settings.termination_drain_duration.total_seconds()
        log.info("Graceful termination period is %s, starting...", goformat.duration(period))
        done, _ = await asyncio.wait({self._exited}, timeout=period)
        if done:
            self._log_early_exit()
        else:
            log.info("Graceful termination period complete, terminating remaining proxies.")

    def _log_early_exit(self) -> None:
        """Envoy exited by itself while the agent was waiting for the drain (Istio's two lines)."""
        assert self._exited is not None
        log.info("Envoy exited with status %s", goformat.exit_text(self._exited.result()))
        log.info("Graceful termination logic ended prematurely, envoy process terminated early")

    async def _drain_until_idle(self, began: float) -> None:
        """EXIT_ON_ZERO_ACTIVE_CONNECTIONS: wait until no connection is left, or Envoy exits.

        Beyond Istio (which waits for kubelet's SIGKILL), the wait is bounded by drainDuration (the
        ``--drain-time-s`` Envoy was told) counted from the start of the drain: a connection that
        never closes cannot keep the agent alive forever.
        """
        assert self._exited is not None
        bound = self._settings.drain_duration.total_seconds()
        remaining = max(0.0, began + bound - asyncio.get_running_loop().time())
        idle = asyncio.get_running_loop().create_task(self._wait_for_zero_connections(), name="envoy-drain")
        try:
            done, _ = await asyncio.wait(
                {self._exited, idle}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            idle.cancel()
            await asyncio.gather(idle, return_exceptions=True)
        if self._exited in done:
            self._log_early_exit()
        elif not done:
            log.warning(
                "Envoy still has active connections %ss after the drain began (drainDuration); "
                "terminating it",
                f"{bound:g}",
            )

    async def _wait_for_zero_connections(self) -> None:
        """Sleep MINIMUM_DRAIN_DURATION, then poll Envoy's stats until no active connection is left.

        Returns when the count is 0, when Envoy reports no stats at all (-1), or after
        MAX_STATS_FAILURES consecutive failed polls; the caller bounds the whole wait.
        """
        minimum = self._settings.minimum_drain_duration.total_seconds()
        log.info(
            "Agent draining proxy for %s, then waiting for active connections to terminate...",
            goformat.duration(minimum),
        )
        await asyncio.sleep(minimum)
        log.info("Checking for active connections...")
        failures = 0
        while True:
            try:
                status, body = await self._admin("GET", ACTIVE_CONNECTIONS_PATH, STATS_REQUEST_TIMEOUT)
                if status != 200:
                    raise AdminError(f"HTTP status {status}")
            except AdminError as err:
                failures += 1
                log.warning(
                    "Checking Envoy's active connections failed (%d/%d): %s",
                    failures,
                    MAX_STATS_FAILURES,
                    err,
                )
                if failures >= MAX_STATS_FAILURES:
                    log.warning("Giving up on Envoy's active connections; terminating proxy...")
                    return
            else:
                failures = 0
                count = active_connections(body, self._settings)
                if count == 0:
                    log.info("There are no more active connections. terminating proxy...")
                    return
                if count < 0:
                    log.info("Envoy reported no connection stats; terminating proxy...")
                    return
                log.info("There are still %d active connections", count)
            await asyncio.sleep(self._poll_interval)

    async def _watch(self, process: asyncio.subprocess.Process) -> int:
        returncode = await process.wait()
        if self._aborting:
            pass  # killed by us while stopping: drain_and_stop/kill report it
        elif returncode == 0:
            log.info("Envoy exited normally")
        else:
            reason = goformat.exit_text(returncode)
            if returncode == -signal.SIGKILL:
                log.warning("Envoy may have been out of memory killed. Check memory usage and limits.")
            log.error("Envoy exited with error: %s", reason)
        self._remove_bootstrap()
        return returncode

    def _remove_bootstrap(self) -> None:
        if self._owns_bootstrap:
            try:
                self._bootstrap_path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("failed to remove Envoy bootstrap %s: %s", self._bootstrap_path, err.strerror)
