"""``agentctl proxy-config secret``: the command, its bad inputs, and ``--diff`` against a real agent side.

The agent side here is the real status server serving a real secret manager's ``/debug/secrets``;
Envoy's side is a config dump file made from what that manager served (the end-to-end test with a
real Envoy is ``tests/e2e/test_proxy_config_secret.py``).
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from istio_agent.cli.agentctl import main
from istio_agent.ctl.local import free_port
from istio_agent.ctl.proxyconfig import SecretQuery, resolve_target, run
from istio_agent.ctl.secrets import SecretsError
from istio_agent.metrics import Registry
from istio_agent.security.debug import secrets_view
from istio_agent.security.model import ROOT_CERT, WORKLOAD_KEY_CERT
from istio_agent.status.readiness import Readiness
from istio_agent.status.server import StatusServer
from tests.ctl.secretdumps import dump, root_secret, tls_secret
from tests.security.fakes import FakeCA
from tests.security.test_manager import make_settings, started


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["proxy-config", "secret", *args])
    return result.exit_code, result.stdout, result.stderr


def test_an_address_that_does_not_answer_is_a_clear_error() -> None:
    port = free_port()
    code, out, err = invoke(f"127.0.0.1:{port}", "--timeout", "2")
    assert code == 1 and out == ""
    assert err.startswith(f"Error: Envoy's admin at 127.0.0.1:{port}: cannot connect to 127.0.0.1:{port}")


@pytest.mark.parametrize("address", ["nonsense", "host:99999", "::1:15000"])
def test_a_malformed_address_is_a_clear_error(address: str) -> None:
    code, _, err = invoke(address)
    assert code == 1 and err.startswith("Error: Envoy's admin address ")


def test_a_file_that_is_not_a_config_dump_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "clusters.json"
    bad.write_text('{"cluster_statuses": []}')
    code, out, err = invoke("-f", str(bad))
    assert code == 1 and out == ""
    assert err == f'Error: {bad} is not an Envoy config dump: no "configs" list at the top\n'


def test_a_dump_file_positionally_or_with_f(tmp_path: Path) -> None:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(dump()))
    for args in (("-f", str(path)), (str(path),)):
        assert invoke(*args) == (0, "No active or warming secrets found.\n", "")  # istioctl's words
    # -o json|yaml print the (empty) SecretsConfigDump as istioctl does, never a sentence
    code, out, _ = invoke("-f", str(path), "-o", "json")
    assert code == 0 and isinstance(json.loads(out), dict)
    code, _, err = invoke("127.0.0.1:15000", "-f", str(path))
    assert code == 1 and "either an admin address or -f FILE" in err
    assert resolve_target(None, None) == ("127.0.0.1:15000", None)


def test_invalid_output_is_refused() -> None:
    code, _, err = invoke("-o", "wide")
    assert code == 2 and "'wide' is not one of" in err


async def test_diff_against_the_agents_status_server(tmp_path: Path) -> None:
    """Envoy holding what the agent served agrees; after a rotation the old dump is a mismatch."""
    ca = FakeCA()
    out_dir = tmp_path / "out"
    settings = make_settings(
        tmp_path, SECRET_TTL="2s", SECRET_GRACE_PERIOD_RATIO_JITTER="0", OUTPUT_CERTS=str(out_dir)
    )
    manager, recorder = await started(settings, ca)
    server = StatusServer(
        "127.0.0.1", 0, Readiness([]), secrets=lambda: secrets_view(manager), registry=Registry()
    )
    await server.start()
    try:
        item = await manager.generate(WORKLOAD_KEY_CERT)
        root = await manager.generate(ROOT_CERT)
        envoy = tmp_path / "envoy.json"
        envoy.write_text(
            json.dumps(
                dump(
                    active=[
                        tls_secret("default", item.certificate_chain),
                        root_secret("ROOTCA", root.root_cert),
                    ]
                )
            )
        )
        agent = f"127.0.0.1:{server.port}"
        lines: list[str] = []
        notes: list[str] = []
        await run(SecretQuery(file=str(envoy), diff=True, agent=agent), lines.append, notes.append)
        table = "\n".join(lines).splitlines()
        assert table[0].split() == [
            "RESOURCE",
            "NAME",
            "TYPE",
            "VALID",
            "CERT",
            "NODE",
            "AGENT",
            "PROXY",
            "SERIAL",
            "NUMBER",
            "NOT",
            "AFTER",
            "NOT",
            "BEFORE",
        ]
        assert table[1].split()[:6] == ["default", "Cert", "Chain", "true", agent, "ACTIVE"]
        assert table[2].split()[:5] == ["ROOTCA", "CA", "true", agent, "ACTIVE"]
        assert table[3] == ""
        assert table[4].split()[0] == "FILE"
        assert {tuple(line.split()[::4]) for line in table[5:]} == {
            (str(out_dir / "cert-chain.pem"), "SAME"),
            (str(out_dir / "root-cert.pem"), "SAME"),
        }
        assert notes == []

        await recorder.wait_for(
            WORKLOAD_KEY_CERT
        )  # the agent rotated; the saved dump is Envoy still holding the old one
        async with asyncio.timeout(5):  # OUTPUT_CERTS is rewritten in the background
            while (out_dir / "cert-chain.pem").read_bytes() == item.certificate_chain:
                await asyncio.sleep(0.01)
        lines, notes = [], []
        await run(
            SecretQuery(file=str(envoy), diff=True, agent=agent, output="json"), lines.append, notes.append
        )
        document = json.loads(lines[0])
        states = [(row["resource_name"], row["agent"], row["proxy"]) for row in document["secrets"]]
        assert states == [
            ("default", "PRESENT", ""),
            ("default", "", "ACTIVE"),
            ("ROOTCA", "PRESENT", "ACTIVE"),
        ]
        verdicts = {f["path"]: f["envoy"] for f in document["files"]}
        assert verdicts[str(out_dir / "cert-chain.pem")] == "DIFFERENT"
        assert any(note.startswith("MISMATCH default: Envoy holds serial") for note in notes)
        assert any(note.startswith(f"MISMATCH file {out_dir / 'cert-chain.pem'} different") for note in notes)
    finally:
        await server.stop()
        await manager.stop()


async def test_diff_with_an_agent_that_is_not_there(tmp_path: Path) -> None:
    envoy = tmp_path / "envoy.json"
    envoy.write_text(json.dumps(dump()))
    port = free_port()
    with pytest.raises(SecretsError, match=f"^the agent at 127.0.0.1:{port}: cannot connect"):
        await run(SecretQuery(file=str(envoy), diff=True, agent=f"127.0.0.1:{port}"), print, print)


async def test_an_address_that_accepts_but_never_answers_times_out() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(SecretsError, match=rf"^Envoy's admin at {address} did not answer within 0.3s$"):
            await run(SecretQuery(address=address, timeout=0.3), print, print)


async def test_something_that_is_not_envoys_admin_is_named() -> None:
    """The agent's status port given as Envoy's admin: a 404, said with its body."""
    server = StatusServer("127.0.0.1", 0, Readiness([]), registry=Registry())
    await server.start()
    try:
        address = f"127.0.0.1:{server.port}"
        with pytest.raises(
            SecretsError, match=rf"^Envoy's admin at {address} answered 404: 404 page not found"
        ):
            await run(SecretQuery(address=address), print, print)
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("alias", "command"),
    [
        (["ps"], ["proxy-status"]),
        (["pc", "s"], ["proxy-config", "secret"]),
        (["proxy-config", "secrets"], ["proxy-config", "secret"]),
        (["pc", "clusters"], ["proxy-config", "cluster"]),
        (["pc", "l"], ["proxy-config", "listener"]),
        (["pc", "ep"], ["proxy-config", "endpoint"]),
        (["pc", "ec"], ["proxy-config", "ecds"]),
        (["pc", "o"], ["proxy-config", "log"]),
        (["pc", "rc"], ["proxy-config", "rootca-compare"]),
    ],
)
def test_istioctls_aliases_run_the_same_command(alias: list[str], command: list[str]) -> None:
    def help_text(words: list[str]) -> str:
        result = CliRunner().invoke(main, [*words, "--help"])
        assert result.exit_code == 0, result.output
        return result.output.split("\n", 1)[1]  # past "Usage: agentctl <words>"

    assert help_text(alias) == help_text(command)
