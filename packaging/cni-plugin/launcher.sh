#!/bin/sh
# istio-cni, as a container runtime execs it: the bundled CPython, started by the bundled glibc's own
# loader, so that nothing of the host's (no Python, any C library or none) is used. Built by
# packaging/cni-plugin/build.py; istio-cni-runtime/ must sit beside this file (copy both, do not link).
case $0 in */*) here=${0%/*} ;; *) here=. ;; esac
rt=$here/istio-cni-runtime
OPENSSL_CONF=$rt/openssl.cnf exec "$rt/lib/@LOADER@" --inhibit-cache --library-path "$rt/lib" \
    "$rt/bin/@PYTHON@" -I -S -c 'from istio_agent.cni.plugin_main import main; main()' "$@"
