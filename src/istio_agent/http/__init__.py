"""The agent's one HTTP stack: h11 (HTTP/1.1) and h2 (HTTP/2) over asyncio streams.

- ``server``/``messages``: an HTTP/1.1 server (runner + sites) for the status port and the tools;
- ``client``: an HTTP/1.1 client (Envoy's admin API, merged metrics, probes, ``pilot-agent wait``);
- ``h2client``: an HTTP/2 client for HTTPS-h2 and gRPC-health app probes;
- ``dial``: the dialing both clients share (source address, TLS with ALPN);
- ``headers``: the header list all of them use.

Nothing is re-exported here, so importing one module loads only what it needs (the status server
must not load h2 at start-up).
"""
