"""Run pilot-agent's ``main`` in this process, as its entry point would, and collect what it printed."""

from __future__ import annotations

import contextlib
import io
import os


def pilot_agent(*argv: str, **env: str) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``pilot-agent <argv>``; ``env`` is added to the process's."""
    from istio_agent.cli.pilot_agent import main

    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(argv))
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()
