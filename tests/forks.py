"""A forked child for the tests of what a fork hands a child (locks): it lives until the block ends."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def child_alive() -> Iterator[int]:
    """Fork a child that does nothing until the block ends (its fork hooks have run by then or soon after); its
    pid. The child ends and is waited for at the block's end."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lives until told to end
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        yield pid
    finally:
        os.close(w)
        os.waitpid(pid, 0)
