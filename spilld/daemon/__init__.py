"""The spilld service (``spilld serve``): one process, one Unix socket, one queue and one store for every engine.

``listen``: the socket and its peer; ``logs``: log format and throttle; ``connection``: one client's frames,
requests and open spills; ``ingest``: accepting spills and the bytes they hold; ``server``: the ``Daemon`` itself.
"""

from __future__ import annotations

from .ingest import MAX_OPEN_SPILLS
from .listen import AlreadyRunning, PeerRefused, is_served
from .logs import setup_logging
from .server import Daemon, run

__all__ = ["MAX_OPEN_SPILLS", "AlreadyRunning", "Daemon", "PeerRefused", "is_served", "run", "setup_logging"]
