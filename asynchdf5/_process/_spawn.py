"""Starting the helper process (a fresh interpreter, as ``spawn`` starts one) and reaping it."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

__all__ = ["EXIT_WAIT_S", "reap", "spawn"]

_log = logging.getLogger("asynchdf5")

#: How long closing waits for the helper to exit before it is killed.
EXIT_WAIT_S = 10.0


def spawn(sock: socket.socket, payload: bytes) -> subprocess.Popen[bytes]:
    """Start ``python -m asynchdf5._serve FD`` (a fresh interpreter: fork and exec at once, as
    the ``spawn`` start method does, never a fork of this process and its threads) and write
    ``payload`` to its standard input."""
    fd = sock.fileno()
    proc = subprocess.Popen(
        [sys.executable, "-m", "asynchdf5._serve", str(fd)],
        stdin=subprocess.PIPE,
        pass_fds=(fd,),
        env=_child_env(),
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BaseException:
        reap(proc, 0)
        raise
    return proc


def _child_env() -> dict[str, str]:
    """This process's environment, with this package importable from where it was imported."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def reap(proc: subprocess.Popen[bytes], wait: float = EXIT_WAIT_S) -> None:
    """Wait for ``proc`` to exit; kill it after ``wait`` seconds."""
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        _log.warning("asynchdf5: the helper process %d did not exit: killed", proc.pid)
        proc.kill()
        proc.wait()
