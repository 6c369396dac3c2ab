"""The daemon's logs: JSON lines for service managers, and a throttle for lines a client can provoke."""

from __future__ import annotations

import json
import logging
import sys
import time

CLIENT_ERROR_LOGS_PER_S = 10  # log lines a second about misbehaving clients; the rest are counted, then summarized
CLIENT_NAMES_KEPT = 1024  # a client name connects at info once (a status poll, an engine), then at debug


class LogThrottle:
    """At most ``per_s`` lines a second; the lines held back are counted for a summary line.

    A client that misbehaves on purpose, in a loop, must not be able to fill the disk with our logs.
    """

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self.held = 0
        self._window = -1.0
        self._sent = 0

    def allow(self) -> bool:
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._sent = now, 0
        if self._sent >= self.per_s:
            self.held += 1
            return False
        self._sent += 1
        return True

    def take_held(self) -> int:
        held, self.held = self.held, 0
        return held


# What every LogRecord has: anything else on a record came from ``extra={...}`` and is a field of the line.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
RESERVED_FIELDS = ("ts", "level", "logger", "msg", "exc")  # an extra with one of these names is prefixed with x_


def record_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields a call passed with ``extra={...}``, as they will appear in the line."""
    out: dict[str, object] = {}
    for k, v in vars(record).items():
        if k not in _RECORD_ATTRS and not k.startswith("_"):
            out[f"x_{k}" if k in RESERVED_FIELDS else k] = v
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, then each field of ``extra={...}`` as a key of its own."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        d |= record_fields(record)
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


class TextFormatter(logging.Formatter):
    """For a terminal: the message, then the fields as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if not fields:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the fields
        return head + " " + " ".join(f"{k}={json.dumps(v, default=str)}" for k, v in fields.items()) + sep + tail


def setup_logging(level: str = "info", json_logs: bool | None = None) -> None:
    """JSON lines when stderr is not a terminal (service managers, files); plain text on a terminal."""
    handler = logging.StreamHandler(sys.stderr)
    use_json = not sys.stderr.isatty() if json_logs is None else json_logs
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    root = logging.getLogger("spilld")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # asyncio's own lines (a task's exception never retrieved, a slow callback) are the daemon's too: same format
    aio = logging.getLogger("asyncio")
    aio.handlers[:] = [handler]
    aio.setLevel(logging.WARNING)
    aio.propagate = False
