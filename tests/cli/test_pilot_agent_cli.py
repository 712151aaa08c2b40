"""pilot-agent's command line as cobra reads Istio's: commands, Go-style flags, help, errors, exit 255.

Errors exit 255 (Istio's ``os.Exit(-1)``) with one ``Error: <why>`` line on stderr; help exits 0.
The command line is read with argparse (``cli/flags.py``): click costs the agent 1.7 MB (issue 23).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from istio_agent import __version__
from tests.cli.invoke import pilot_agent
from tests.test_import_side_effects import RUNNING_AGENT_NEVER_LOADS

COMMANDS = ("istio-iptables", "proxy", "request", "version", "wait")


def run(*argv: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    return subprocess.run(
        [sys.executable, "-m", "istio_agent.cli.pilot_agent", *argv],
        cwd=cwd or "/",
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


# --- the root -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"], ["help"], ["--log_as_json"]])
def test_the_root_prints_its_help_listing_the_commands(argv: list[str]) -> None:
    code, out, err = pilot_agent(*argv)
    assert (code, err) == (0, "")
    assert out.startswith("usage: pilot-agent [command]")
    assert "Istio's workload agent (pilot-agent), in Python." in out
    listed = [line.split()[0] for line in out.split("Available Commands:\n")[1].splitlines() if line.strip()]
    assert [name for name in listed if name in COMMANDS] == sorted(COMMANDS)
    assert "--log_output_level" in out


def test_an_unknown_command_exits_255() -> None:
    code, out, err = pilot_agent("nosuch")
    assert (code, out) == (255, "")
    assert err == 'Error: unknown command "nosuch" for "pilot-agent"\n'


@pytest.mark.parametrize(
    "argv",
    [
        ["--vklog=3", "--log_caller=", "version", "-s"],
        ["--vklog", "3", "version", "-s"],
        ["--log_output_level", "default:debug", "--log_target", "a", "--log_target=b", "version", "-s"],
        ["version", "-s", "--log_as_json"],  # root flags are persistent in cobra: after the command too
        ["--log_as_json=false", "version", "--short"],
    ],
)
def test_root_flags_before_or_after_the_command(argv: list[str]) -> None:
    assert pilot_agent(*argv) == (0, f"{__version__}\n", "")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command: str) -> None:
    for argv in ([command, "--help"], [command, "-h"], ["help", command]):
        code, out, err = pilot_agent(*argv)
        assert (code, err) == (0, ""), argv
        assert out.startswith(f"usage: pilot-agent {command} ")
        assert "--log_vklog" not in out and "--vklog" not in out  # root flags are listed at the root only


# --- version --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-s"], f"{__version__}\n"),
        (["--short=true"], f"{__version__}\n"),
        (["-ojson"], f'"version": "{__version__}"'),
        (["-o=json"], f'"version": "{__version__}"'),
        (["--output", "yaml"], f"version: {__version__}\n"),
        (["--short=false"], f'version.BuildInfo{{Version:"{__version__}"'),
        ([], f'version.BuildInfo{{Version:"{__version__}"'),
    ],
)
def test_version_forms(argv: list[str], expected: str) -> None:
    code, out, err = pilot_agent("version", *argv)
    assert (code, err) == (0, "")
    assert expected in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-o", "xml"], "--output must be 'yaml' or 'json'"),  # Istio's pkg/version/cobra.go
        (["--bogus"], "No such option '--bogus'."),
        (["extra"], "Got unexpected extra argument (extra)"),
        (["a", "b"], "Got unexpected extra arguments (a b)"),
        (["--short=maybe"], "invalid value for --short: invalid boolean 'maybe' (expected true or false)"),
        (["-o"], "Option '-o' requires an argument."),
    ],
)
def test_version_errors_exit_255(argv: list[str], message: str) -> None:
    assert pilot_agent("version", *argv) == (255, "", f"Error: {message}\n")


def test_an_unknown_flag_before_the_command_is_the_commands_error() -> None:
    assert pilot_agent("--bogus", "version") == (255, "", "Error: No such option '--bogus'.\n")


# --- wait and request: flag errors before any work -------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["wait", "extra"], "Got unexpected extra argument (extra)"),
        (["wait", "--timeoutSeconds"], "Option '--timeoutSeconds' requires an argument."),
        (["request", "GET", "--debug-port=8080", "stats"], "debug port 8080 is not in allowed list"),
        (["request", "--debug-port"], "Option '--debug-port' requires an argument."),
        (["request", "--bogus", "GET", "x"], "No such option '--bogus'."),
    ],
)
def test_wait_and_request_flag_errors(argv: list[str], message: str) -> None:
    code, out, err = pilot_agent(*argv)
    assert (code, out) == (255, "")
    assert err.startswith(f"Error: {message}")


# --- proxy (subprocesses: it configures the process's logging) ------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # pflag skips a whitelisted unknown flag with the value after it: "x" is not the proxy type
        (["--someFutureFlag", "x", "gateway"], "invalid proxy Type: gateway"),
        (["--someFutureFlag=x", "--other", "-q", "--also=1", "gateway"], "invalid proxy Type: gateway"),
        (["--profiling=false", "--concurrency", "2", "gateway", "extra"], "invalid proxy Type: gateway"),
        (["--concurrency=x"], "invalid value 'x' for --concurrency: not an integer"),
        (["--stsPort", "x"], "invalid value 'x' for --stsPort: not an integer"),
        (["gateway", "--domain"], "Option '--domain' requires an argument."),
        (["--profiling=maybe"], "invalid value for --profiling: invalid boolean 'maybe'"),
        (["--log_output_level=default:loud"], "invalid log level 'loud' for scope 'default'"),
    ],
)
def test_proxy_command_line_errors_exit_255(short_tmp: Path, argv: list[str], message: str) -> None:
    done = run("proxy", *argv, cwd=short_tmp)
    assert done.returncode == 255, done.stderr
    assert done.stderr.startswith(f"Error: {message}"), done.stderr
    assert done.stderr.count("\n") == 1


def test_root_log_flags_reach_proxy(short_tmp: Path) -> None:
    done = run("--log_output_level=default:loud", "proxy", "gateway", cwd=short_tmp)
    assert done.returncode == 255
    assert "invalid log level 'loud'" in done.stderr


# --- what the process loads -----------------------------------------------------------------------------

LOADED = textwrap.dedent(
    """
    import json, sys
    from istio_agent.cli import pilot_agent
    try:
        pilot_agent.main(sys.argv[1:])
    except SystemExit:
        pass
    print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("click", "grpc"))))
    """
)


@pytest.mark.parametrize("argv", [[], ["--help"], ["proxy", "--help"], ["version"], ["istio-iptables", "-h"]])
def test_the_command_line_loads_no_click(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=30, check=True
    )
    assert json.loads(done.stdout.splitlines()[-1]) == []


RUNNING = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time
    from pathlib import Path

    def report() -> None:  # once the agent serves its xDS socket: what it has loaded, then stop it
        socket = Path("etc/istio/proxy/XDS")
        while not socket.exists():
            time.sleep(0.05)
        time.sleep(1)
        never = set(os.environ["TEST_NEVER_LOADS"].split(","))
        names = sorted(m for m in sys.modules if m in never or m.split(".")[0] in never)
        Path("loaded.json").write_text(json.dumps(names))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=report, daemon=True).start()
    from istio_agent.cli.pilot_agent import main
    main()
    """
)


def test_a_running_agent_started_by_main_loads_none_of_what_it_does_without(short_tmp: Path) -> None:
    """``pilot-agent proxy`` through ``main``, serving (no Envoy, plaintext control plane refused)."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    env.update(
        DISABLE_ENVOY="true",
        PROXY_CONFIG=json.dumps({"discoveryAddress": "127.0.0.1:15010", "statusPort": 0}),
        TEST_NEVER_LOADS=",".join(RUNNING_AGENT_NEVER_LOADS),
    )
    agent = subprocess.Popen(
        [sys.executable, "-c", RUNNING, "proxy", "sidecar", "--log_output_level=default:info"],
        cwd=short_tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = agent.communicate(timeout=40)
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGKILL)
            agent.communicate()
    assert agent.returncode == 0, output
    assert json.loads((short_tmp / "loaded.json").read_text()) == [], output
    assert "received termination signal" in output
