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


def test_pinning_spawns_nothing_and_loads_no_ctypes_util() -> None:
    """It runs at every agent start: no ``ldconfig`` child, no ``ctypes.util`` (tempfile, shutil) loaded."""
    import subprocess
    import sys

    probe = (
        "import subprocess, sys\n"
        "spawned = []\n"
        "subprocess.Popen.__init__ = lambda self, *a, **k: spawned.append(a)\n"
        "from istio_agent.memory import pin_mmap_threshold\n"
        "pin_mmap_threshold()\n"
        "print(len(spawned), 'ctypes.util' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.split() == ["0", "False"]
