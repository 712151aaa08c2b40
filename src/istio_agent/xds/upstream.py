"""Dialling istiod for the xDS proxy: a fresh channel for every downstream stream, as in Istio.

Credentials, headers and the channel (:class:`istio_agent.rpc.channel.Channel`: keepalive as
Istio's, pings on an idle stream too) come from ``istiod/dial.py`` (shared with the CA client) and
are read at each dial: a root certificate replaced on disk, or a client
certificate re-provisioned, is picked up by the next stream without restarting the agent, while
streams already open are left alone.
"""

from __future__ import annotations

from istio_agent.config.xds import XdsSettings
from istio_agent.istiod.dial import CredentialError, IstiodCredentials, IstiodEndpoint
from istio_agent.istiod.tokens import FileTokenSource, TokenSource
from istio_agent.rpc.channel import Channel

MAX_RECV_BYTES = 2**31 - 1
"""Istio lets istiod send messages of any size (math.MaxInt32): a large mesh has large CDS/EDS
pushes. The agent's channel sets no maximum of its own."""


class DialError(Exception):
    """The upstream cannot be dialled (credentials missing or unusable); the message says why."""


class UpstreamDialer:
    """Opens channels to the discovery address with Istio's options and credentials."""

    def __init__(self, settings: XdsSettings, tokens: TokenSource | None = None) -> None:
        """``tokens``: the agent's credential fetcher, the one its CA client uses (Istio shares it too);
        without one, the token file of ``settings``, if any."""
        self._endpoint = IstiodEndpoint.for_xds(settings)
        if tokens is None and settings.token_path is not None:
            tokens = FileTokenSource(settings.token_path)
        self._credentials = IstiodCredentials(self._endpoint, tokens)

    @property
    def address(self) -> str:
        return self._endpoint.address

    def describe(self) -> str:
        """The upstream as shown in logs and in errors sent to Envoy (address, and TLS server name)."""
        if self._endpoint.plaintext:
            return f"{self.address} (plaintext)"
        return f"{self.address} (TLS, server name {self._endpoint.server_name})"

    def dial(self) -> Channel:
        """A new channel (it connects at its first call); raises DialError when TLS credentials cannot
        be built from the files."""
        try:
            material = self._credentials.material()
        except CredentialError as err:
            raise DialError(str(err)) from None
        return self._credentials.channel(material)

    def metadata(self) -> list[tuple[str, str]]:
        """Headers of one upstream stream: cluster id, XDS_HEADER_*, and the token read now."""
        return self._credentials.metadata()
