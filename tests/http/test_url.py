"""``URL.parse`` against the standard library's reading of the same URLs.

``http/url.py`` splits URLs itself so that the CNI plugin, which parses its kubeconfig's server on
every ADD, does not import ``urllib.parse`` (~1 ms, docs/performance.md). What it accepts must
read as ``urllib.parse.urlsplit`` reads it; the only difference allowed is that it refuses more
(spaces and control characters, which ``urlsplit`` silently strips or keeps, and anything but a
port after a bracketed address).
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from istio_agent.http.url import URL, HTTPError

SAME_AS_URLSPLIT = [
    "http://127.0.0.1:8080/stats?filter=a%5E&usedonly",
    "https://10.96.0.1:443",
    "https://10.96.0.1:443/",
    "https://kubernetes.default.svc/api/v1/namespaces/ns/pods/p",
    "HTTPS://Kubernetes.Default.SVC:6443/Path/Kept?Q=1",
    "http://h",
    "http://h?",
    "http://h?a=1",
    "http://h/#frag",
    "http://h/p?q#frag?x",
    "http://h#frag",
    "http://h:/x",
    "http://h:0/x",
    "http://h:65535/x",
    "http://user:pass@h:81/x",
    "http://us@er@h/x",
    "https://[::1]/x",
    "https://[::1]:8443/x?y",
    "https://[FE80::1%25Eth0]:1/x",
    "https://[2001:DB8::1]/",
    "http://h/a;b/c?d;e",
    "http://h//double//slashes",
    "http://xn--bcher-kva.example/",
]
REFUSED_BY_BOTH = [
    "ftp://h/",
    "http:///x",
    "http://h:99999/",
    "http://h:-1/",
    "http://h:8a/",
    "http://h:80:81/",
    "http://h:\u0661/",  # an Arabic-Indic digit: isdigit, not ASCII
    "nonsense",
    "http:/h/x",
    "//h/x",
    "http://[::1/x",
    "http://::1]/x",
    "http://[1.2.3.4]/x",
    "http://[not-an-address]/x",
    "http://user@/x",
]
REFUSED_HERE_ONLY = [
    " http://h/",
    "http://h/\n",
    "http://h /x",
    "http://h/a\tb",
    "http://h/\x7f",
    "http://[::1]x/",
]


def reference(url: str) -> URL:
    """What ``URL.parse`` read with ``urlsplit`` before it split URLs itself."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise HTTPError(f"invalid URL {url!r}: {err}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise HTTPError(f"invalid URL {url!r}")
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return URL(scheme, parts.hostname, port or {"http": 80, "https": 443}[scheme], target)


@pytest.mark.parametrize("url", SAME_AS_URLSPLIT)
def test_a_url_reads_as_urlsplit_reads_it(url: str) -> None:
    assert URL.parse(url) == reference(url)


@pytest.mark.parametrize("url", REFUSED_BY_BOTH)
def test_what_urlsplit_refuses_is_refused(url: str) -> None:
    with pytest.raises(HTTPError):
        reference(url)
    with pytest.raises(HTTPError, match="invalid URL"):
        URL.parse(url)


@pytest.mark.parametrize("url", REFUSED_HERE_ONLY)
def test_spaces_and_control_characters_are_refused(url: str) -> None:
    with pytest.raises(HTTPError, match="invalid URL"):
        URL.parse(url)


def test_str_and_join_round_trip() -> None:
    url = URL.parse("https://[::1]:8443/a/b?c")
    assert str(url) == "https://[::1]:8443/a/b?c"
    assert URL.parse(str(url)) == url
    assert str(url.join("../d#f")) == "https://[::1]:8443/d"
