"""``pilot-agent`` command line: exit codes and start-up errors as Istio's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from istio_agent import __version__
from tests.cli.invoke import pilot_agent

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


OVERFLOW = "99999999999h"  # beyond Go's time.Duration (about 292 years)


def plaintext_config(**fields: object) -> str:
    return json.dumps({"discoveryAddress": "127.0.0.1:15010", **fields})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SECRET_TTL": OVERFLOW}, f'SECRET_TTL={OVERFLOW!r}: time: invalid duration "{OVERFLOW}"'),
        ({"FILE_DEBOUNCE_DURATION": OVERFLOW}, "FILE_DEBOUNCE_DURATION"),
        (
            {"GRPC_KEEPALIVE_INTERVAL": OVERFLOW},
            f"GRPC_KEEPALIVE_INTERVAL={OVERFLOW!r}: time: invalid duration",
        ),
        ({"GRPC_KEEPALIVE_TIMEOUT": OVERFLOW}, "GRPC_KEEPALIVE_TIMEOUT"),
        (
            {"DNS_FORWARD_TIMEOUT": OVERFLOW, "ISTIO_META_DNS_CAPTURE": "true"},
            f"DNS_FORWARD_TIMEOUT={OVERFLOW!r}: time: invalid duration",
        ),
        ({"MINIMUM_DRAIN_DURATION": OVERFLOW}, "MINIMUM_DRAIN_DURATION"),
        (
            {"PROXY_CONFIG": plaintext_config(drainDuration=OVERFLOW)},
            f'drainDuration: time: invalid duration "{OVERFLOW}"',
        ),
        ({"PROXY_CONFIG": plaintext_config(terminationDrainDuration=OVERFLOW)}, "terminationDrainDuration"),
        ({"PROXY_CONFIG": plaintext_config(drainDuration=1e300)}, "drainDuration: time: invalid duration"),
        (
            {"PROXY_CONFIG": plaintext_config(terminationDrainDuration="100000h")},
            "must be between 0s and 24h0m0s",
        ),
    ],
)
def test_overflowing_durations_exit_255_with_one_line(
    short_tmp: Path, env: dict[str, str], message: str
) -> None:
    """Durations beyond Go's range were an OverflowError traceback and exit 1."""
    done = run_agent(short_tmp, "proxy", **{"PROXY_CONFIG": plaintext_config(), **env})
    assert done.returncode == 255, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("Error: ") and done.stderr.count("\n") == 1, done.stderr  # one line
    assert message in done.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"WORKLOAD_RSA_KEY_SIZE": "99999999"},
            "WORKLOAD_RSA_KEY_SIZE='99999999': must be between 2048 and 8192",
        ),
        (
            {"SECRET_GRACE_PERIOD_RATIO": "nan"},
            "SECRET_GRACE_PERIOD_RATIO='nan': 'nan' is not a finite number",
        ),
        ({"ISTIO_GPRC_MAXSTREAMS": "9999999999"}, "must be between 1 and 2147483647"),
        ({"ISTIO_CPU_LIMIT": "100000"}, "ISTIO_CPU_LIMIT='100000': must be between 0 and 1024"),
        ({"ENVOY_STATUS_PORT": "70000"}, "ENVOY_STATUS_PORT='70000': must be between 1 and 65535"),
        (
            {"DNS_FORWARD_RETRIES": "1000000", "ISTIO_META_DNS_CAPTURE": "true"},
            "DNS_FORWARD_RETRIES='1000000': must be between 0 and 10",
        ),
        (
            {"PROXY_CONFIG": plaintext_config(concurrency=100000)},
            "concurrency: must be between 0 and 1024, got 100000",
        ),
        (
            {"PROXY_CONFIG": plaintext_config(proxyAdminPort=0)},
            "proxyAdminPort: must be between 1 and 65535, got 0",
        ),
    ],
)
def test_numbers_out_of_bounds_exit_255(short_tmp: Path, env: dict[str, str], message: str) -> None:
    """An absurd number (a 99999999-bit key pinned a core for minutes) fails the start, naming the setting."""
    done = run_agent(short_tmp, "proxy", **{"PROXY_CONFIG": plaintext_config(), **env})
    assert done.returncode == 255, done.stderr
    assert "Traceback" not in done.stderr
    assert message in done.stderr


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
    code, out, _ = pilot_agent("version", "-s")
    assert code == 0
    assert out.strip() == __version__
    assert __version__ in pilot_agent("version", "-o", "json")[1]


def test_istio_root_flags_are_accepted() -> None:
    code, out, err = pilot_agent("--vklog=3", "--log_caller=", "version", "-s")
    assert code == 0, out + err


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


@pytest.mark.parametrize(
    ("target", "variable"),
    [("out/certs", "OUTPUT_CERTS"), ("out/grpc-bootstrap.json", "GRPC_XDS_BOOTSTRAP")],
)
def test_grpc_agent_paths_that_cannot_be_written_exit_255_naming_them(
    short_tmp: Path, target: str, variable: str
) -> None:
    """The grpc-agent template's env; OUTPUT_CERTS or the bootstrap's directory is a file, not a directory."""
    (short_tmp / "out").write_text("a file where a directory should be")
    env = {
        "DISABLE_ENVOY": "true",
        "ISTIO_META_GENERATOR": "grpc",
        "OUTPUT_CERTS": str(short_tmp / "certs"),
        "ISTIO_META_DNS_CAPTURE": "false",
        "PROXY_CONFIG": json.dumps({"discoveryAddress": "127.0.0.1:15010", "statusPort": 0}),
        "CA_ADDR": "127.0.0.1:15010",
        variable: str(short_tmp / target),
    }
    done = run_agent(short_tmp, "proxy", "sidecar", **env)
    assert done.returncode == 255, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("Error: ") and f"{short_tmp / target}" in done.stderr
