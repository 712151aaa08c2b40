"""``pilot-agent`` command line: exit codes and start-up errors as Istio's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from istio_agent import __version__
from istio_agent.cli.pilot_agent import main

PLAINTEXT_CONTROL_PLANE = '{"discoveryAddress": "127.0.0.1:15010"}'


def run_agent(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.pilot_agent", *args],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SECRET_TTL": "one day"}, "SECRET_TTL"),
        ({"ECC_CURVE": "P521"}, "ECC_CURVE"),
        ({"PROXY_CONFIG": "discoveryAddress: nope"}, "discoveryAddress"),
        (
            {"WORKLOAD_IDENTITY_SOCKET_FILE": "spire.sock", "PROXY_CONFIG": PLAINTEXT_CONTROL_PLANE},
            "non-default SDS socket",
        ),
    ],
)
def test_bad_settings_exit_255_with_the_reason(short_tmp: Path, env: dict[str, str], message: str) -> None:
    done = run_agent(short_tmp, "proxy", **env)
    assert done.returncode == 255
    assert message in done.stderr + done.stdout


def test_missing_ca_root_is_a_clear_error(short_tmp: Path) -> None:
    done = run_agent(short_tmp, "proxy", CA_ADDR="127.0.0.1:15012")
    assert done.returncode == 255
    assert "root CA file for XDS does not exist" in done.stderr + done.stdout
    plaintext_xds = run_agent(
        short_tmp, "proxy", CA_ADDR="127.0.0.1:15012", PROXY_CONFIG=PLAINTEXT_CONTROL_PLANE
    )
    assert "root CA file for CA does not exist" in plaintext_xds.stderr + plaintext_xds.stdout


def test_unbindable_socket_path_is_a_clear_error(short_tmp: Path) -> None:
    deep = short_tmp / ("d" * 90)
    deep.mkdir()
    done = run_agent(deep, "proxy", PROXY_CONFIG=PLAINTEXT_CONTROL_PLANE)  # plaintext: no root needed
    assert done.returncode == 255
    assert "longer than 107 bytes" in done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_proxy_type(short_tmp: Path) -> None:
    done = run_agent(short_tmp, "proxy", "gateway")
    assert done.returncode == 255
    assert "invalid proxy Type: gateway" in done.stderr


def test_version() -> None:
    result = CliRunner().invoke(main, ["version", "-s"])
    assert result.exit_code == 0
    assert result.output.strip() == __version__
    assert __version__ in CliRunner().invoke(main, ["version", "-o", "json"]).output


def test_istio_root_flags_are_accepted() -> None:
    result = CliRunner().invoke(main, ["--vklog=3", "--log_caller=", "version", "-s"])
    assert result.exit_code == 0, result.output


def test_injection_template_command_line_is_accepted(short_tmp: Path) -> None:
    """The injected args parse; the run then stops at the first real problem (no CA root here)."""
    done = run_agent(
        short_tmp,
        "proxy",
        "sidecar",
        "--domain",
        "default.svc.cluster.local",
        "--proxyLogLevel=warning",
        "--proxyComponentLogLevel=misc:error",
        "--log_output_level=default:info",
        "--log_as_json",
        "--someFutureFlag=1",
        CA_ADDR="127.0.0.1:15012",
    )
    assert "root CA file for XDS does not exist" in done.stderr + done.stdout
    assert '"scope": "default"' in done.stdout  # --log_as_json after the subcommand took effect
