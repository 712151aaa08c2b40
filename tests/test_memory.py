"""The allocator tuning is applied where glibc exists and is harmless elsewhere."""

from __future__ import annotations

import platform

from istio_agent.memory import pin_mmap_threshold


def test_pin_mmap_threshold_on_glibc() -> None:
    applied = pin_mmap_threshold()
    if platform.libc_ver()[0] == "glibc":
        assert applied is True
    else:
        assert applied is False
