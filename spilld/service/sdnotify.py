"""systemd's notify protocol: one ``KEY=VALUE`` datagram per message to ``$NOTIFY_SOCKET``.

The protocol is stable and small, so it is written here instead of depending on a binding. Every call is a
no-op when ``NOTIFY_SOCKET`` is unset (a terminal, launchd, a test) and none of them ever raises: a lost
notification must not take the daemon down.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("spilld.service")


def notify_address(env: Mapping[str, str] | None = None) -> str | None:
    """The socket to notify, with a leading ``@`` turned into the NUL of Linux's abstract namespace."""
    raw = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not raw or not (raw.startswith("/") or raw.startswith("@")):
        return None  # unset, or a vsock address this daemon never runs under
    return "\0" + raw[1:] if raw.startswith("@") else raw


MAX_WATCHDOG_USEC = 10**12  # 11.6 days: a longer watchdog (or a number too large for a float) pings as if it were this


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WATCHDOG_USEC``), or None when no watchdog is asked of us."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        owner = int(env.get("WATCHDOG_PID", "0"))
    except ValueError:
        return None
    if usec <= 0 or (owner and owner != (os.getpid() if pid is None else pid)):
        return None  # set for another process of the unit, or not set at all
    return min(usec, MAX_WATCHDOG_USEC) / 2 / 1e6


class Notifier:
    """Sends notify messages to one address; does nothing without an address."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls) -> Notifier:
        return cls(notify_address())

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; True if it left, False if disabled or it failed."""
        if self.address is None:
            return False
        text = "\n".join(f"{k}={v}" for k, v in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # the event loop never waits on the service manager
            self._sock.sendto(text.encode(), self.address)
        except OSError as exc:
            log.debug("sd_notify %r failed: %s", text, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"EXTEND_TIMEOUT_USEC": int(seconds * 1e6)}
        if status:
            fields["STATUS"] = status
        return self.send(**fields)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
