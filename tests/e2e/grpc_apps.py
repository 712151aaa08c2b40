"""grpcio's own xDS server and clients as subprocesses, for the proxyless end-to-end tests and bench.

grpcio reads ``GRPC_XDS_BOOTSTRAP`` once per process, so every side that needs its own bootstrap
(its own node and certificates) runs in its own interpreter. The server is
``grpc.server(..., xds=True)`` with ``xds_server_credentials`` (grpcio's aio server has no xDS mode)
and answers ``/test.Echo/Whoami`` with what its TLS stack saw of the caller (the peer certificate
itself replaced by its serial number); clients dial ``xds:///`` with ``xds_channel_credentials``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

TRUST_DOMAIN = "cluster.local"
SERVICE_HOST = "echo.default.svc.cluster.local"
SERVICE_PORT = 7070
CLIENT_ID = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/client"
SERVER_ID = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/echo"
TARGET = f"xds:///{SERVICE_HOST}:{SERVICE_PORT}"

SERVER = r"""
import json, sys
from concurrent import futures
import grpc
import grpc.experimental
from cryptography import x509

def whoami(request, context):
    seen = {key: [v.decode() for v in values] for key, values in context.auth_context().items()}
    pem = seen.pop("x509_pem_cert", None)
    seen = {key: values for key, values in seen.items() if not key.startswith("x509_pem_cert")}
    if pem:
        seen["peer_serial"] = [format(x509.load_pem_x509_certificate(pem[0].encode()).serial_number, "x")]
    return json.dumps(seen).encode()

server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), xds=True)
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
    "test.Echo", {"Whoami": grpc.unary_unary_rpc_method_handler(whoami)}),))
server.add_secure_port(sys.argv[1], grpc.xds_server_credentials(grpc.insecure_server_credentials()))
server.start()
print("started", flush=True)
server.wait_for_termination()
"""

CLIENT = r"""
import json, os, sys, time
import grpc
import grpc.experimental

def channel_for(target):
    if target.startswith("xds:"):
        credentials = grpc.xds_channel_credentials(grpc.experimental.insecure_channel_credentials())
        return grpc.secure_channel(target, credentials)
    return grpc.insecure_channel(target)  # straight to the server's port, without the mesh's mTLS

def call(whoami, timeout):
    try:
        return json.loads(whoami(b"", timeout=timeout, wait_for_ready=True))
    except grpc.RpcError as err:
        return {"error": f"{err.code().name}: {err.details()}"}

mode, timeout, targets = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
if mode == "once":  # each target once, one JSON object of target -> answer
    results = {}
    for target in targets:
        with channel_for(target) as channel:
            results[target] = call(channel.unary_unary("/test.Echo/Whoami"), timeout)
    print(json.dumps(results))
else:  # "loop": one channel, a call every 0.1 s until stdin closes, one JSON line per call with the
    # wall-clock time its answer came
    import threading
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    with channel_for(targets[0]) as channel:
        whoami = channel.unary_unary("/test.Echo/Whoami")
        while not done.is_set():
            answer = call(whoami, timeout)
            print(json.dumps({"at": time.time(), **answer}), flush=True)  # when the answer came
            done.wait(0.1)
"""


def mesh_yaml(server_port: int, server_account: str = "echo") -> str:
    """A grpc service ``echo`` backed by a proxyless server, and a proxyless caller ``client-1``."""
    return f"""
trustDomain: {TRUST_DOMAIN}
services:
  - name: echo
    port: {SERVICE_PORT}
    protocol: grpc
workloads:
  - name: echo-1
    serviceAccount: {server_account}
    proxyless: true
    services: [echo]
    appPort: {server_port}
  - name: client-1
    serviceAccount: client
    proxyless: true
"""


def grpc_env(bootstrap: Path) -> dict[str, str]:
    """This environment, with grpcio pointed at ``bootstrap`` as the grpc-agent template's app is."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GRPC_")}
    env["GRPC_XDS_BOOTSTRAP"] = str(bootstrap)
    env["GRPC_XDS_EXPERIMENTAL_SECURITY_SUPPORT"] = "true"
    return env


def start_server(bootstrap: Path, port: int, log: IO[str]) -> subprocess.Popen[str]:
    """The xDS gRPC server on 127.0.0.1:``port``; it serves once the control plane sent its listener."""
    return subprocess.Popen(
        [sys.executable, "-c", SERVER, f"127.0.0.1:{port}"],
        env=grpc_env(bootstrap),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def call_once(bootstrap: Path, *targets: str, timeout: float = 30) -> dict[str, Any]:
    """Call each target from a fresh client process; target -> what the server saw, or ``error``."""
    done = subprocess.run(
        [sys.executable, "-c", CLIENT, "once", str(timeout), *targets],
        env=grpc_env(bootstrap),
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def start_caller(bootstrap: Path, target: str, output: IO[str], timeout: float = 5) -> subprocess.Popen[str]:
    """A client calling ``target`` every 0.1 s on one channel until its stdin is closed (see ``calls``)."""
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, "loop", str(timeout), target],
        env=grpc_env(bootstrap),
        stdin=subprocess.PIPE,
        stdout=output,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def calls(output: Path) -> list[dict[str, Any]]:
    """The answers a caller wrote so far, one per call, in order."""
    complete = output.read_text().split("\n")[:-1]  # the last piece may be a line still being written
    return [json.loads(line) for line in complete if line.startswith("{")]


def refused(result: dict[str, Any]) -> bool:
    """The call got no answer: the handshake failed (UNAVAILABLE, or the deadline while retrying)."""
    return str(result.get("error", "")).startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
