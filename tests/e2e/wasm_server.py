"""A Wasm module server for pod-shaped tests: serves the files of one directory over plain HTTP and logs
every request it gets to a file, so a test can tell whether the agent fetched a module or took it from
its cache.

It runs as its own process in the pod's network (:meth:`tests.e2e.pod.Pod.run_in_network`), where the
test's threads cannot listen: ``python tests/e2e/wasm_server.py --port N --directory D --requests F``.
Standard library only, so it runs by path with any Python.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

    from tests.e2e.pod import Pod

SCRIPT = Path(__file__).resolve()
LISTEN_TIMEOUT = 10.0


def serve(port: int, directory: Path, requests: Path) -> None:
    """Serve ``directory`` on 127.0.0.1:``port``; one ``<method> <path>`` line per request in ``requests``."""

    class Handler(SimpleHTTPRequestHandler):
        def send_head(self) -> Any:
            with requests.open("a") as log:  # before the answer: a counted request is one the server saw
                log.write(f"{self.command} {self.path}\n")
            return super().send_head()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), partial(Handler, directory=str(directory)))
    server.serve_forever()


def requests_seen(requests: Path) -> list[str]:
    """The requests the server logged, in order."""
    return requests.read_text().splitlines() if requests.exists() else []


def start_module_server(pod: Pod, port: int, directory: Path, requests: Path) -> subprocess.Popen[bytes]:
    """The server in ``pod``'s network, once it listens (its output in ``requests``' directory)."""
    log = requests.with_name("module-server.log")
    args = [sys.executable, str(SCRIPT), "--port", str(port), "--directory", str(directory)]
    process = pod.run_in_network([*args, "--requests", str(requests)], log)
    deadline = time.monotonic() + LISTEN_TIMEOUT
    while not pod.port_open(port):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the module server did not listen on {port}:\n{log.read_text()}")
        time.sleep(0.05)
    return process


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--requests", type=Path, required=True)
    options = parser.parse_args()
    serve(options.port, options.directory, options.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
