"""Whether the containerd tests can run here, and why not (the wording ``tests/ci_skips.py`` reads)."""

from __future__ import annotations

import os
import shutil

from tests.cni.libcni import DEBIAN_PLUGINS
from tests.cri.containerd import NODE_PATH, missing_tools
from tests.cri.pause_image import BUSYBOX

IPTABLES = ("iptables-nft-save", "iptables-nft-restore", "iptables-legacy-save", "ip6tables-nft-save", "ip")


def cannot_run() -> str | None:
    """The reason the containerd tests cannot run, or None."""
    if os.geteuid() != 0:
        return "needs root: containerd, runc and network namespaces (CI runs as root)"
    missing = missing_tools()
    missing += [tool for tool in IPTABLES if shutil.which(tool, path=NODE_PATH) is None]
    missing += [str(DEBIAN_PLUGINS / p) for p in ("bridge", "host-local", "portmap", "loopback")]
    missing = [m for m in missing if not (m.startswith("/") and os.path.exists(m))]
    if not BUSYBOX.is_file():
        missing.append(str(BUSYBOX))
    if missing:
        return (
            f"Debian's containerd, runc, iptables, iproute2, containernetworking-plugins or busybox-static "
            f"are not installed ({', '.join(missing)}): `make` installs them"
        )
    return None
