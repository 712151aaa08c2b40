"""``proxy-config log``: istioctl's ``--level`` syntax, checks and messages; then a real Envoy's ``/logging``.

The rules are those of istioctl 1.28's ``logCmd`` (``istioctl/pkg/proxyconfig/proxyconfig.go`` at
ff49c188): logger names are checked against the listing Envoy itself answers (a substring test), a
bare level sets every logger (``level=...``) and is sent before the named ones.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from istio_agent.ctl import envoylog
from istio_agent.ctl.envoylog import LogLevelError, LogQuery, parse_levels, updates
from istio_agent.ctl.local import free_port, wait_until
from istio_agent.envoy.binary import find_envoy

LISTING = "active loggers:\n  admin: warning\n  http: warning\n  http2: warning\n  redis: warning\n"


# -- parsing --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "levels"),
    [
        ("debug", {"level": "debug"}),
        ("warn", {"level": "warning"}),
        ("http:debug", {"http": "debug"}),
        ("http=debug", {"http": "debug"}),
        ("http:debug,redis:info", {"http": "debug", "redis": "info"}),
        ("level:info", {"level": "info"}),
        ("info,http:debug", {"level": "info", "http": "debug"}),
        # A bare level replaces everything before it, as istioctl's map assignment does.
        ("http:debug,info", {"level": "info"}),
        # Only the part after the last "::" is read (istioctl's "namespace" prefix).
        ("envoy::http:trace", {"http": "trace"}),
        # The name is checked by substring against Envoy's listing, as istioctl does.
        ("htt:debug", {"htt": "debug"}),
        ("http:error,http:off", {"http": "off"}),
    ],
)
def test_level_syntax(spec: str, levels: dict[str, str]) -> None:
    assert parse_levels(spec, LISTING) == levels


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("none", "unrecognized logging level: none"),
        ("DEBUG", "unrecognized logging level: DEBUG"),
        ("http:loud", "unrecognized logging level: loud"),
        ("mongo:debug", "unrecognized logger name: mongo"),
        ("http:debug,", "unrecognized logging level: "),
        ("http:debug:x", "unrecognized logging level: debug:x"),
    ],
)
def test_level_errors_are_istioctls(spec: str, message: str) -> None:
    with pytest.raises(LogLevelError) as caught:
        parse_levels(spec, LISTING)
    assert str(caught.value) == message


def test_a_namespace_prefix_without_a_level_is_an_error_not_a_crash() -> None:
    # istioctl indexes past the end here ("a::http:" is fine, "a::http" panics); we say what is missing.
    with pytest.raises(LogLevelError, match="unrecognized logging level: ") as caught:
        parse_levels("a::http", LISTING)
    assert "a::http" in str(caught.value)


def test_updates_send_the_level_for_all_first_then_each_logger() -> None:
    assert updates({"http": "debug", "level": "info", "redis": "off"}) == [
        "level=info",
        "http=debug",
        "redis=off",
    ]
    assert updates({}) == []


def test_reset_is_warning_for_all() -> None:
    assert envoylog.reset_levels() == {"level": "warning"}


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (LogQuery(level="debug", reset=True), "--level cannot be combined with --reset"),
        (LogQuery(output="json"), "--output is not applicable for this command"),
        (LogQuery(output="yaml"), "--output is not applicable for this command"),
    ],
)
def test_flag_checks(query: LogQuery, message: str) -> None:
    with pytest.raises(LogLevelError) as caught:
        envoylog.check(query)
    assert str(caught.value) == message


def test_short_and_empty_output_are_accepted() -> None:
    envoylog.check(LogQuery(output="short"))
    envoylog.check(LogQuery(output=""))


def test_unreachable_envoy_is_istioctls_first_error() -> None:
    from istio_agent.cli import runtime

    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(LogLevelError, match=r"^failed to execute command on Envoy: "):
        runtime.run(envoylog.run(LogQuery(address=address, timeout=2), lambda _: None))


# -- a real Envoy ---------------------------------------------------------------------------------------
@contextmanager
def admin_envoy(directory: Path, **resources: Any) -> Iterator[str]:
    """A real Envoy with an admin listener (and the bootstrap sections given); its admin address."""
    port = free_port()
    bootstrap = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}},
        "node": {"id": "ctl-test", "cluster": "ctl-test"},
        **resources,
    }
    config = directory / f"envoy-{port}.json"
    config.write_text(json.dumps(bootstrap))
    log = directory / f"envoy-{port}.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [str(find_envoy()), "-c", str(config), "--base-id", str(port), "-l", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    address = f"127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://{address}/ready", timeout=1):
                    return True
            except OSError:
                return False

        wait_until(up, 20, "Envoy's admin")
        yield address
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def envoy(short_tmp: Path) -> Iterator[str]:
    with admin_envoy(short_tmp) as address:
        yield address


def envoy_levels(address: str) -> dict[str, str]:
    """What Envoy itself reports (a POST to /logging without parameters changes nothing)."""
    request = urllib.request.Request(f"http://{address}/logging", method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
    return dict(re.findall(r"^  (\S+): (\S+)$", text, re.MULTILINE))


def agentctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.agentctl", "proxy-config", "log", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def listed(stdout: str, address: str) -> dict[str, str]:
    head, _, body = stdout.partition("\n")
    assert head == f"{address}:"
    assert body.startswith("active loggers:\n")
    return dict(re.findall(r"^  (\S+): (\S+)$", body, re.MULTILINE))


@pytest.mark.e2e
def test_no_flags_lists_envoys_loggers(envoy: str) -> None:
    done = agentctl(envoy)
    assert done.returncode == 0, done.stderr
    levels = listed(done.stdout, envoy)
    assert levels == envoy_levels(envoy)
    assert levels["http"] == "warning" and len(levels) > 20


@pytest.mark.e2e
def test_level_for_named_loggers_changes_envoy_and_reports_it(envoy: str) -> None:
    done = agentctl(envoy, "--level", "http:debug,redis=info")
    assert done.returncode == 0, done.stderr
    now = envoy_levels(envoy)
    assert (now["http"], now["redis"], now["admin"]) == ("debug", "info", "warning")
    assert listed(done.stdout, envoy) == now


@pytest.mark.e2e
def test_a_bare_level_then_a_logger(envoy: str) -> None:
    done = agentctl(envoy, "--level", "error,http:trace")
    assert done.returncode == 0, done.stderr
    now = envoy_levels(envoy)
    assert now["http"] == "trace"
    assert {level for name, level in now.items() if name != "http"} == {"error"}


@pytest.mark.e2e
def test_reset_puts_every_logger_back_to_warning(envoy: str) -> None:
    assert agentctl(envoy, "--level", "debug,http:trace").returncode == 0
    assert set(envoy_levels(envoy).values()) == {"debug", "trace"}
    done = agentctl(envoy, "-r")
    assert done.returncode == 0, done.stderr
    assert set(envoy_levels(envoy).values()) == {"warning"}
    assert set(listed(done.stdout, envoy).values()) == {"warning"}


@pytest.mark.e2e
def test_unknown_logger_is_refused_before_envoy_is_changed(envoy: str) -> None:
    done = agentctl(envoy, "--level", "debug,nosuchlogger:info")
    assert done.returncode == 1
    assert done.stderr == "Error: unrecognized logger name: nosuchlogger\n"
    assert done.stdout == ""
    assert set(envoy_levels(envoy).values()) == {"warning"}


@pytest.mark.e2e
def test_a_name_that_passes_istioctls_substring_test_is_refused_by_envoy(envoy: str) -> None:
    # "htt" is in Envoy's listing (inside "http"), so istioctl sends it and Envoy answers 400.
    done = agentctl(envoy, "--level", "htt:debug")
    assert done.returncode == 1
    assert done.stderr == (
        "Error: 1 error occurred:\n"
        f"\t* error configuring log level for {envoy}: "
        "failed to execute command on Envoy: unexpected status code: 400\n\n\n"
    )  # hashicorp/go-multierror's list, then cobra's Println


@pytest.mark.e2e
def test_flag_errors_from_the_command_line(envoy: str) -> None:
    done = agentctl(envoy, "--level", "debug", "--reset")
    assert (done.returncode, done.stderr) == (1, "Error: --level cannot be combined with --reset\n")
    done = agentctl(envoy, "-o", "json")
    assert (done.returncode, done.stderr) == (1, "Error: --output is not applicable for this command\n")
    done = agentctl(envoy, "--level", "none")
    assert (done.returncode, done.stderr) == (1, "Error: unrecognized logging level: none\n")
