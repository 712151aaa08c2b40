"""install-cni's work: install the plugin, keep it installed while the node changes, and take it out on exit.

Istio: ``cni/pkg/install/install.go``. One *pass* copies the binaries, writes the kubeconfig and,
when the CNI config no longer holds our entry as configured, writes it again. Between passes the
installer waits for a change (a file in the config directory, a copied binary, the service-account
token) and is *ready* only while waiting with everything in place.

Beyond Istio (see docs/compatibility.md): the file we chained into is checked as a whole and, when
it is corrupt, left alone with readiness false and the reason; another component that keeps removing
our entry gets a back-off (:mod:`.guard`) instead of an endless rewrite loop; a changed entry of ours
(other settings after an upgrade) is rewritten, not only a missing one; install-cni is not ready while
the plugin (its launcher and, beside it, its whole runtime directory) is on none of the host's CNI
bin directories. Cleanup removes only what this process installed, and keeps the kubeconfig and the
plugin when our entry cannot be taken out.

With ambient enabled, the ambient node agent (:mod:`istio_agent.cni.install.ambient`) is started before
the first pass, as Istio's ``root.go`` starts it before its installer, and stopped when the run ends;
install-cni is ready only while both are. A stop that is an upgrade (install-cni's DaemonSet still
there) leaves the plugin installed and the agent's host rules in place, as Istio's does.
"""

from __future__ import annotations

import asyncio
import enum
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from istio_agent import goformat
from istio_agent.cni.install import conffiles, kubeconfig
from istio_agent.cni.install.binaries import CopyError, copy_binaries, plugin_problem, remove_plugin
from istio_agent.cni.install.conffiles import CniConfigError, NoNetworksError
from istio_agent.cni.install.guard import ConflictGuard, Throttle
from istio_agent.cni.install.settings import InstallSettings
from istio_agent.cni.install.watch import DirWatcher
from istio_agent.cni.plugin_config import PLUGIN_TYPE
from istio_agent.files import write_atomic
from istio_agent.log import scope
from istio_agent.metrics import Registry

if TYPE_CHECKING:
    from istio_agent.cni.install.ambient import AmbientAgent

log = scope("cni-agent")

SUCCESS = "SUCCESS"
COPY_BINARIES_FAILURE = "COPY_BINARIES_FAILURE"
CREATE_KUBECONFIG_FAILURE = "CREATE_KUBECONFIG_FAILURE"
CREATE_CNI_CONFIG_FAILURE = "CREATE_CNI_CONFIG_FAILURE"
CORRUPT = "corrupt"
CONFLICT = "conflict"
RECHECK_SECONDS = 30.0
"""While waiting, the config is checked again this often even without an event (a missed event costs no more)."""
MISSING_DIR_POLL_SECONDS = 1.0
"""A directory that does not exist cannot be watched: look again this often."""


P = ParamSpec("P")
T = TypeVar("T")


async def off_loop(func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``func`` (blocking file work) in a thread, so ``/readyz``, ``/healthz`` and signals are served meanwhile.

    A cancel (SIGTERM) waits for the work to end before it propagates: cleanup must never run while
    a write of ours is half-way, nor undo a file that the write then puts back.
    """
    work = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait({work})
        raise


class InstallError(Exception):
    """A pass failed in a way install-cni cannot wait out (Istio exits, and kubelet restarts the pod)."""


class Check(enum.Enum):
    """What a look at the installed config finds: fine, to be (re)written, or corrupt (left alone)."""

    OK = "ok"
    REWRITE = "rewrite"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class Verdict:
    """What the config file needs, and why (the log line and the readiness reason)."""

    check: Check
    reason: str = ""
    repair: bool = False
    """Our entry was taken out of (or changed in) the file we had written: counted by the conflict guard."""


class InstallMetrics:
    """Istio's install-cni metrics and ours for the guardian."""

    def __init__(self, registry: Registry) -> None:
        self.installs = registry.counter(
            "cni_installs_total",
            "Total number of CNI plugins installed by the Istio CNI installer",
            ["result"],
        )
        self.ready = registry.gauge(
            "cni_install_ready", "Whether the CNI plugin installation is ready or not"
        )
        self.conflicts = registry.counter(
            "cni_config_conflicts_total",
            "Times install-cni stopped rewriting the CNI config because another component kept removing its entry",
        )
        self.blocked = registry.gauge(
            "cni_config_blocked",
            "1 while install-cni leaves the CNI config alone on purpose (reason: corrupt or conflict)",
            ["reason"],
        )
        for reason in (CORRUPT, CONFLICT):
            self.blocked.labels(reason).set(0)


class Installer:
    """The install passes and the wait between them; ``run`` until cancelled, then ``cleanup``."""

    def __init__(
        self,
        settings: InstallSettings,
        registry: Registry,
        *,
        throttle: Throttle | None = None,
        guard: ConflictGuard | None = None,
        recheck_seconds: float = RECHECK_SECONDS,
        ambient: AmbientAgent | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = InstallMetrics(registry)
        self._registry = registry
        self.ambient = ambient
        """The ambient node agent (built at :meth:`run` from the settings when not given)."""
        self._upgrading = False
        """The run ended for an upgrade in ambient mode: cleanup leaves the plugin installed."""
        self._throttle = throttle or Throttle()
        self._guard = guard or ConflictGuard()
        self._recheck = recheck_seconds
        self._auto = not settings.cni_conf_name
        self._entry = conffiles.entry(settings.plugin)
        self._standalone = conffiles.parse(conffiles.standalone_text(settings.plugin))
        """The standalone file's document: what a standalone config must equal."""
        self.config_path: Path | None = None
        """The config file holding our entry (written by us); cleanup restores or removes it."""
        self._binaries: set[str] | None = None
        self._copied: set[Path] = set()
        """Binaries (files and the runtime directory) this process installed: the only ones cleanup may remove."""
        self._kubeconfig_written = False
        self._ready = False
        self._reason = "installing"
        self._logged: set[str] = set()
        """Block reasons logged since the config was last fine (each is logged once)."""
        self._warned: set[str] = set()

    # -- readiness ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """The install is in place, and the ambient node agent (when enabled) is ready."""
        return self._ready and (self.ambient is None or self.ambient.ready)

    @property
    def reason(self) -> str:
        """Why install-cni is not ready (empty when ready)."""
        if self.ambient is not None and not self.ambient.ready:
            return self.ambient.reason
        return self._reason

    @reason.setter
    def reason(self, value: str) -> None:
        self._reason = value

    def _set_ready(self, ready: bool, reason: str = "") -> None:
        self._ready = ready
        self.reason = "" if ready else (reason or self.reason or "installing")
        self.metrics.ready.set(1 if ready else 0)

    def _block(self, kind: str, reason: str) -> None:
        """Leave the config alone on purpose: readiness false with ``reason``, the metric, one log line per reason."""
        self.metrics.blocked.labels(kind).set(1)
        self._report(reason)

    def _report(self, reason: str) -> None:
        """Not ready because of something on the node that install-cni cannot fix: one error line per reason."""
        self._set_ready(False, reason)
        if reason not in self._logged:
            self._logged.add(reason)
            log.error("%s", reason)

    def _unblock(self) -> None:
        for kind in (CORRUPT, CONFLICT):
            self.metrics.blocked.labels(kind).set(0)
        self._logged.clear()

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Install, then keep it installed until cancelled; raises InstallError when a pass fails.

        With ambient enabled the node agent starts first and stops when this ends."""
        agent = await self._start_node_agent()
        try:
            await self.install_all()
            while True:
                await self._throttle.wait(str(self.config_path or ""))
                await self.sleep_watch_install()
                await self.install_all()
        finally:
            if agent is not None:
                self._upgrading = await agent.is_upgrade()
                log.info("Ambient node agent shutting down - should stop cleanup? %s", self._upgrading)
                await agent.stop(cleanup=not self._upgrading)

    async def _start_node_agent(self) -> AmbientAgent | None:
        if self.ambient is None and self.settings.ambient is not None:
            from istio_agent.cni.install.ambient import AmbientSetupError, build_node_agent

            try:
                self.ambient = build_node_agent(self.settings, self._registry)
            except AmbientSetupError as err:
                raise InstallError(str(err)) from None
        if self.ambient is None:
            return None
        log.info(
            "Starting ambient node agent with inpod redirect mode on socket %s",
            self.ambient.agent.events.socket_path,
        )
        try:
            await self.ambient.start()
        except asyncio.CancelledError:  # stopped while still waiting for its first lists
            await self.ambient.stop(cleanup=False)
            raise
        except Exception as err:  # a socket it cannot have, host rules that do not go in
            await self.ambient.stop(cleanup=False)
            raise InstallError(f"failed to create ambient nodeagent service: {err}") from None
        log.info("Ambient node agent started, starting installer...")
        return self.ambient

    async def install_all(self) -> None:
        """One pass: binaries, kubeconfig, then the CNI config if it needs writing."""
        settings = self.settings
        try:
            copied = await off_loop(
                copy_binaries, settings.cni_bin_source_dir, settings.cni_bin_target_dirs, self._copied
            )
        except CopyError as err:
            self.metrics.installs.labels(COPY_BINARIES_FAILURE).inc()
            raise InstallError(str(err)) from None
        if self._binaries is None:
            self._binaries = copied  # only the first set is watched, as in Istio
        try:
            document = await off_loop(self._write_kubeconfig)
        except (kubeconfig.KubeconfigError, OSError) as err:
            self.metrics.installs.labels(CREATE_KUBECONFIG_FAILURE).inc()
            raise InstallError(f"failed to write the kubeconfig: {err}") from None
        log.info(
            "wrote kubeconfig file %s with: \n%s",
            settings.kubeconfig_path,
            kubeconfig.render(kubeconfig.redacted(document)),
        )
        try:
            await self._install_config()
        except (CniConfigError, OSError) as err:
            self.metrics.installs.labels(CREATE_CNI_CONFIG_FAILURE).inc()
            raise InstallError(f"failed to write the CNI config: {err}") from None
        self.metrics.installs.labels(SUCCESS).inc()

    def _write_kubeconfig(self) -> dict[str, Any]:
        document = kubeconfig.write(self.settings)
        self._kubeconfig_written = True
        return document

    async def _install_config(self) -> None:
        verdict = await off_loop(self.check)
        if verdict.check is Check.OK:
            self._unblock()
            log.info("existing CNI config %s is valid", self.config_path)
            return
        if verdict.check is Check.CORRUPT:
            self._block(CORRUPT, verdict.reason)
            return
        if verdict.repair and self._guard_says_wait():
            return
        log.info(
            'configuration requires updates, (re)writing CNI config file at "%s": %s',
            self.config_path or "",
            verdict.reason,
        )
        if await self.create_config_file() is not None:
            self._unblock()
            log.info("Istio CNI configuration and binaries validated/reinstalled")

    def _guard_says_wait(self) -> bool:
        """Whether the conflict guard holds the repair back (and, the first time, why)."""
        remaining = self._guard.remaining()
        if remaining > 0:
            return True
        backoff = self._guard.record_repair()
        if backoff is None:
            return False
        self.metrics.conflicts.inc()
        hint = ""
        if self.config_path is not None and "cilium" in self.config_path.name:
            hint = " Hint: Cilium is writing it; set 'cni.exclusive=false' in the Cilium configuration."
        self._block(
            CONFLICT,
            f"another component keeps rewriting the CNI config {self.config_path} without istio-cni; "
            f"not fighting it: no rewrite for {goformat.duration(backoff)}.{hint}",
        )
        return True

    async def sleep_watch_install(self) -> None:
        """Wait until something changes (return at once when the config needs a rewrite); ready meanwhile."""
        settings = self.settings
        binaries = frozenset({*(self._binaries or ()), PLUGIN_TYPE})
        interests: list[tuple[Path, frozenset[str] | None]] = [
            (target, binaries) for target in settings.cni_bin_target_dirs
        ]
        interests.append((settings.cni_bin_source_dir, frozenset({PLUGIN_TYPE})))  # a missing plugin arriving
        interests.append((settings.mounted_cni_net_dir, None))
        interests.append((settings.service_account_dir, None))
        backoff = self._guard.remaining()
        if backoff > 0:
            await asyncio.sleep(backoff)  # out of the fight: changes meanwhile are the other side's
            return
        with DirWatcher(interests) as watcher:
            verdict, missing = await off_loop(self._survey)
            if verdict.check is Check.REWRITE:
                self._set_ready(False, verdict.reason)
                return
            if verdict.check is Check.CORRUPT:
                self._block(CORRUPT, verdict.reason)
            elif watcher.pending():
                return
            else:
                self._unblock()
                if missing:
                    self._report(missing)
                else:
                    self._set_ready(True)
            try:
                while not await watcher.wait(self._recheck):
                    now, now_missing = await off_loop(self._survey)
                    if now.check is not verdict.check or bool(now_missing) != bool(missing):
                        break
            finally:
                self._set_ready(False, self.reason or "detected changes to the node-level CNI setup")
        log.info(
            "detected changes to the node-level CNI setup, checking to see if configs or binaries need redeploying"
        )

    def _survey(self) -> tuple[Verdict, str]:
        """What the config needs, and why the plugin cannot be exec'd ("" when it can): one look, off the loop."""
        return self.check(), self.missing_plugin()

    def missing_plugin(self) -> str:
        """Why the runtime could not exec the plugin our entry names ("" when it could).

        Its launcher must be in one of the host's CNI bin directories with its whole runtime beside
        it (the source's directories); without them every pod sandbox on the node fails, so
        install-cni is not ready (Istio stays ready).
        """
        settings = self.settings
        problems = {
            target: plugin_problem(settings.cni_bin_source_dir, target, PLUGIN_TYPE)
            for target in settings.cni_bin_target_dirs
        }
        if not all(problems.values()):
            return ""
        for target, problem in problems.items():
            if (target / PLUGIN_TYPE).is_file():
                return f"the plugin {PLUGIN_TYPE} in {target} cannot run: {problem}"
        where = ", ".join(str(target) for target in settings.cni_bin_target_dirs)
        reason = f"the plugin binary {PLUGIN_TYPE} is missing from {where}"
        if not (settings.cni_bin_source_dir / PLUGIN_TYPE).is_file():
            reason += f", and {settings.cni_bin_source_dir} has none to copy"
        return reason

    # -- the CNI config ----------------------------------------------------------------------------

    def check(self) -> Verdict:
        """Whether the config file we wrote still holds our entry as configured, is corrupt, or needs writing."""
        settings = self.settings
        chained = settings.chained_cni_plugin
        directory = settings.mounted_cni_net_dir
        current = self.config_path
        candidate = current
        if candidate is None and chained and not self._auto:
            candidate = conffiles.resolve_name(directory, settings.cni_conf_name)
        document: object = None
        if chained and candidate is not None and candidate.exists():
            document, problem = conffiles.load_chained(candidate)
            if problem is not None:
                return Verdict(Check.CORRUPT, conffiles.corrupt_reason(candidate, problem))
        if current is None:
            return Verdict(Check.REWRITE, "the CNI config is not installed yet")
        try:
            files, skipped = conffiles.config_filenames(directory)
        except NoNetworksError as err:
            return Verdict(Check.REWRITE, str(err))
        for name, why in skipped.items():
            self._log_once(f"skipping invalid CNI config file {directory / name}: {why}")
        first = directory / files[0]
        if first != current:
            if self._auto and chained:
                return Verdict(Check.REWRITE, f"CNI config file {current} preempted by {first}")
            self._log_once(f"CNI config file {current} preempted by {first}")
        if not current.exists():
            return Verdict(Check.REWRITE, f"CNI config file removed: {current}")
        if chained:
            return self._check_chained(current, document)
        return self._check_standalone(current)

    def _check_chained(self, current: Path, document: object) -> Verdict:
        assert isinstance(document, dict)  # chain_problem passed
        entries = conffiles.istio_entries(document)
        if not entries:
            return Verdict(
                Check.REWRITE, f"istio-cni CNI config removed from CNI config file: {current}", repair=True
            )
        if len(entries) > 1:
            return Verdict(Check.REWRITE, f"more than one istio-cni entry in {current}")
        if document["plugins"][entries[0]] != self._entry:
            return Verdict(
                Check.REWRITE,
                f"the istio-cni entry in {current} differs from the configured one",
                repair=True,
            )
        return Verdict(Check.OK)

    def _check_standalone(self, current: Path) -> Verdict:
        try:
            document = conffiles.read_document(current)
        except CniConfigError as err:
            return Verdict(Check.REWRITE, str(err))
        if not isinstance(document, dict) or document.get("type") != PLUGIN_TYPE:
            return Verdict(Check.REWRITE, f"{current} is not the istio-cni config")
        if document != self._standalone:
            return Verdict(Check.REWRITE, f"{current} differs from the configured istio-cni config")
        return Verdict(Check.OK)

    async def create_config_file(self) -> Path | None:
        """Write our entry (waiting for the primary config when chained); None when the target is corrupt.

        The file written becomes :attr:`config_path` at once, in the writing thread: a SIGTERM that
        arrives meanwhile still finds it to clean up.
        """
        settings = self.settings
        if not settings.chained_cni_plugin:
            path = settings.mounted_cni_net_dir / (settings.cni_conf_name or conffiles.STANDALONE_NAME)
            await off_loop(self._write_standalone, path)
            log.info("created CNI config %s", path)
            return path
        path = await self._chain_target()
        document, problem = await off_loop(conffiles.load_chained, path)
        if problem is not None:
            # Only a file we had not chosen yet can be corrupt here (kubelet skipped it too): a named one.
            self._block(CORRUPT, conffiles.corrupt_reason(path, problem))
            return None
        destination = await off_loop(self._write_chained, path, document)
        log.info("created CNI config %s", destination)
        return destination

    def _write_standalone(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, conffiles.standalone_text(self.settings.plugin), self.settings.conf_file_mode)
        self.config_path = path

    def _write_chained(self, path: Path, document: object) -> Path:
        chained = conffiles.insert_entry(document, self._entry)
        mode = stat.S_IMODE(path.stat().st_mode)
        destination = path.with_name(path.name + "list") if path.suffix == ".conf" else path
        write_atomic(destination, conffiles.marshal(chained), mode)
        self.config_path = destination
        if destination != path:
            path.unlink(missing_ok=True)
        return destination

    async def _chain_target(self) -> Path:
        """The primary config to chain into, waiting until there is one (Istio's getCNIConfigFilepath)."""
        directory = self.settings.mounted_cni_net_dir
        while True:
            with DirWatcher([(directory, None)]) as watcher:
                name = self.settings.cni_conf_name
                if self._auto:
                    try:
                        name = (await off_loop(conffiles.config_filenames, directory))[0][0]
                    except NoNetworksError as err:
                        name = ""
                        self._set_ready(False, f"waiting for a primary CNI config: {err}")
                if name:
                    path = conffiles.resolve_name(directory, name)
                    if path is not None:
                        return path
                    self._set_ready(False, f"waiting for the CNI config file {directory / name}")
                log.info("%s", self.reason)
                await watcher.wait(None if directory.is_dir() else MISSING_DIR_POLL_SECONDS)

    def _log_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)

    # -- on exit -----------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Undo what this process installed: our entry (or standalone file), the kubeconfig, the plugin.

        Files this process did not write are not touched (another install-cni may be serving the node).
        The plugin is its launcher, then the runtime directory beside it. When our entry cannot be
        taken out, the kubeconfig and the plugin stay, as in Istio's Cleanup
        (``cni/pkg/install/install.go``): a config chaining a missing plugin fails every pod sandbox.
        """
        settings = self.settings
        if self._upgrading:
            log.info("an upgrade of the ambient node agent: leaving the plugin in place for the next one")
            return
        log.info("cleaning up")
        if not self._remove_config():
            log.error(
                "keeping the kubeconfig %s and the %s plugin: the CNI config %s may still chain istio-cni, "
                "and without them every pod sandbox on this node would fail",
                settings.kubeconfig_path,
                PLUGIN_TYPE,
                self.config_path,
            )
            return
        if self._kubeconfig_written:
            try:
                settings.kubeconfig_path.unlink(missing_ok=True)
                log.info("removed kubeconfig %s", settings.kubeconfig_path)
            except OSError as err:
                log.warning("cannot remove the kubeconfig %s: %s", settings.kubeconfig_path, err.strerror)
        remove_plugin(self._copied, PLUGIN_TYPE)

    def _remove_config(self) -> bool:
        """Take our entry out of the config we wrote; False when it may still be there."""
        path = self.config_path
        if path is None or not path.exists():
            return True
        if self.settings.chained_cni_plugin:
            return self._remove_entry(path)
        log.info("removing Istio CNI config file %s", path)
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("cannot remove the Istio CNI config file %s: %s", path, err.strerror)
            return False
        return True

    def _remove_entry(self, path: Path) -> bool:
        try:
            document = conffiles.read_document(path)
            cleaned = conffiles.remove_entry(document)
            mode = stat.S_IMODE(path.stat().st_mode)
            write_atomic(path, conffiles.marshal(cleaned), mode)
        except (CniConfigError, OSError) as err:
            log.warning("leaving the CNI config %s as it is: %s", path, err)
            return False
        log.info("removed the istio-cni entry from CNI config file %s", path)
        return True
