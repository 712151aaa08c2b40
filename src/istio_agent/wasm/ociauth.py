"""Answering an OCI registry's 401: its challenges, Basic credentials, the Bearer token flow.

As docker and go-containerregistry do (Istio pulls with the latter): the first Basic or Bearer
challenge is answered; a pull secret's ``registrytoken`` is sent as the Bearer token as it is; an
``identitytoken`` is exchanged at the realm by the OAuth2 refresh-token grant, falling back to the
plain token GET (with the Basic credentials, if any) when the realm has no OAuth2 (404).

Every Bearer realm is held to Istio's realm rules (:func:`istio_agent.wasm.ssrf.check_bearer_realm`)
before anything is sent to it, and is dialled through the guard like every other connection. Where
we differ from Istio, on purpose: only Bearer realms are held to those rules (Istio applies them to
Basic realms too, which are names, not URLs, so it refuses every htpasswd-protected registry); the
Basic credentials of a token request go to the realm's origin only, not to where it redirects.
"""

from __future__ import annotations

import base64
import json
import re
from urllib.parse import urlencode

from istio_agent.http.client import URL, HTTPError
from istio_agent.http.headers import Headers
from istio_agent.wasm.dockerconfig import Credentials
from istio_agent.wasm.errors import FetchError
from istio_agent.wasm.guarded import GuardedClient
from istio_agent.wasm.ssrf import check_bearer_realm

MAX_TOKEN_BYTES = 1 << 20
OAUTH_CLIENT_ID = "istio-agent"

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TOKEN68 = re.compile(r"\s+[A-Za-z0-9._~+/-]+=*\s*(?:,|$)")
_PARAM = re.compile(r'\s*([!#$%&\'*+.^_`|~0-9A-Za-z-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,]*)\s*(?:,|$)')

Challenge = tuple[str, dict[str, str]]
"""A scheme, lower-cased, and its parameters."""


async def authorization(
    client: GuardedClient, headers: Headers, credentials: Credentials, repository: str
) -> str | None:
    """The ``Authorization`` to send after a 401 with ``headers`` (``None``: none, pull anonymously).

    ``FetchError`` when a Bearer realm breaks the realm rules (nothing is sent to it), no challenge is
    Basic or Bearer, or no token can be had.
    """
    challenges = [c for value in headers.getall("WWW-Authenticate") for c in parse_challenges(value)]
    for scheme, params in challenges:
        if scheme == "bearer" and "realm" in params:
            try:
                check_bearer_realm(params["realm"])
            except FetchError as err:
                raise FetchError(f"rejected unsafe bearer realm: {err}") from None
    chosen = next(((s, p) for s, p in challenges if s in ("basic", "bearer")), None)
    if chosen is None:
        raise FetchError(f"the registry asks for authentication this client cannot give: {challenges!r}")
    scheme, params = chosen
    if credentials.registry_token:
        return f"Bearer {credentials.registry_token}"
    if scheme == "basic":
        return basic(credentials) if credentials.username else None
    return f"Bearer {await _token(client, params, credentials, repository)}"


def basic(credentials: Credentials) -> str:
    pair = f"{credentials.username}:{credentials.password}".encode()
    return f"Basic {base64.b64encode(pair).decode()}"


def parse_challenges(value: str) -> list[Challenge]:
    """The challenges of one ``WWW-Authenticate`` value: ``[(scheme lower-cased, {param: value})]``."""
    challenges: list[Challenge] = []
    position = 0
    while position < len(value):
        while position < len(value) and value[position] in " \t,":
            position += 1
        scheme = _TOKEN.match(value, position)
        if scheme is None:
            next_comma = value.find(",", position)
            position = len(value) if next_comma < 0 else next_comma + 1
            continue
        position = scheme.end()
        params: dict[str, str] = {}
        if (token68 := _TOKEN68.match(value, position)) is not None and "=" in token68.group().rstrip(" ,="):
            token68 = None  # a parameter (name=value), not a token68 blob
        if token68 is not None:
            challenges.append((scheme.group().lower(), params))
            position = token68.end()
            continue
        while (param := _PARAM.match(value, position)) is not None and param.end() > position:
            name, raw = param.groups()
            params[name.lower()] = re.sub(r"\\(.)", r"\1", raw[1:-1]) if raw.startswith('"') else raw
            position = param.end()
        challenges.append((scheme.group().lower(), params))
    return challenges


async def _token(
    client: GuardedClient, params: dict[str, str], credentials: Credentials, repository: str
) -> str:
    realm = params.get("realm")
    if not realm:
        raise FetchError("the registry's Bearer challenge has no realm")
    query = {"scope": f"repository:{repository}:pull"}
    if params.get("service"):
        query = {"service": params["service"], **query}
    target = _realm_url(realm + ("&" if "?" in realm else "?") + urlencode(query))
    status, body = 404, b""
    if credentials.identity_token:
        status, body = await _refresh(client, realm, query, credentials.identity_token)
    if status == 404:  # no identity token, or a realm without OAuth2: the plain token GET
        auth = basic(credentials) if credentials.username else None
        fetched = await client.fetch("GET", target, authorization=auth, max_body=MAX_TOKEN_BYTES)
        status, body = fetched.status, fetched.body
    if status != 200:
        raise FetchError(f"token request to {target.host} for {query['scope']}: status {status}")
    try:
        answer = json.loads(body)
        token = answer.get("token") or answer.get("access_token")
    except (ValueError, AttributeError):
        token = None
    if not isinstance(token, str) or not token:
        raise FetchError(f"token response from {target.host} holds no token")
    return token


async def _refresh(
    client: GuardedClient, realm: str, query: dict[str, str], identity_token: str
) -> tuple[int, bytes]:
    """The OAuth2 refresh-token grant docker and go-containerregistry make with an identity token."""
    form = {
        "grant_type": "refresh_token",
        "refresh_token": identity_token,
        **query,
        "client_id": OAUTH_CLIENT_ID,
    }
    fetched = await client.fetch(
        "POST",
        _realm_url(realm),
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        body=urlencode(form).encode(),
        max_body=MAX_TOKEN_BYTES,
    )
    return fetched.status, fetched.body


def _realm_url(text: str) -> URL:
    try:
        return URL.parse(text)
    except HTTPError as err:
        raise FetchError(f"bearer realm: {err}") from None
