"""Why a Wasm module could not be had: one error type, its ``reason`` a ``wasm_remote_fetch_count`` label."""

from __future__ import annotations

from istio_agent.wasm import metrics


class FetchError(Exception):
    """A module could not be fetched, or what was fetched is not the module asked for.

    ``reason`` is the ``result`` label it is counted under (``download_failure``, ``manifest_failure``,
    ``checksum_mismatched``); the message says what went wrong in words an operator can act on, and
    never carries a pull secret.
    """

    def __init__(self, message: str, reason: str = metrics.DOWNLOAD_FAILURE) -> None:
        super().__init__(message)
        self.reason = reason
