"""Process memory tuning for the agent (what GOMEMLIMIT is to Istio's Go agent).

The xDS proxy relays istiod's pushes, which can be megabytes each, through buffers that gRPC's
threads and the event loop allocate and free. glibc raises its mmap threshold every time such a
buffer is freed, after which the next ones come from the heap arenas and their pages stay with the
process: resident memory then ratchets up with every large push. Pinning the threshold at 128 KiB
keeps large buffers in their own mappings, which go back to the kernel as soon as they are freed.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3
"""glibc's mallopt() parameter number for the mmap threshold (malloc.h)."""
MMAP_THRESHOLD_BYTES = 128 * 1024


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold (disabling its dynamic growth); False where there is no glibc.

    The C library is the one the interpreter already runs on (``CDLL(None)``): ``ctypes.util``'s
    search would spawn ``ldconfig`` at start-up and keep ``tempfile`` and ``shutil`` loaded (~1.4 MB).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
