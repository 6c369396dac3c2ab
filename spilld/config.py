"""Daemon settings: sizes, default folders and the socket path."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .admission import MAX_ADMIT_AFTER
from .blocks import DEFAULT_BLOCK_TOKENS
from .fileio import Durability
from .format import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS

DEFAULT_WARM_BUDGET = 2 * 1024**3  # bytes the warm start reads ahead at most (less if the store holds less)
DEFAULT_WARM_RATE = 200 * 1024 * 1024  # bytes a second: a fraction of any SSD's, so serving keeps the disk
DEFAULT_IO_TIMEOUT_S = 30.0  # a write step, a restore's read or an unlink that takes longer: the disk is hung
DEFAULT_SCRUB_RATE = 32 * 1024 * 1024  # bytes a second: a terabyte checked in about 9 hours of idle time
DEFAULT_SCRUB_INTERVAL_S = 24 * 3600.0  # a scrub pass starts at most once a day

_UNITS = {
    "": 1,
    "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "B": 1,
}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")  # ASCII digits only (\d takes any script's)
MAX_SIZE = 1 << 62  # larger than any disk; keeps every sum of sizes inside an int64
MAX_DURATION_S = 100 * 365 * 86400  # a century: past this a number is a typo, and timers overflow
MAX_HOST_NAME_BYTES = 255  # --remote-host-name, UTF-8 (a DNS name is at most 253): it goes in every event


def parse_size(text: str, *, minimum: int = 1) -> int:
    """'4GiB', '512MiB', '2G' (K/M/G/T and KiB.. are powers of 1024; KB/MB/GB/TB of 1000).

    Every size spilld takes is a cap, so 0 is refused unless ``minimum`` allows it.
    """
    if text.strip().startswith("-"):
        raise ValueError(f"{text!r}: a size cannot be negative")
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 2G, 10GB)")
    n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not math.isfinite(n) or n > MAX_SIZE:  # int() of an infinite float raises, not ValueError
        raise ValueError(f"{text!r}: larger than any disk (at most {MAX_SIZE} bytes)")
    if _UNITS[m.group(2).upper()] == 1 and n != int(n):  # 1.5B (found in review: cut to 1 without a word)
        raise ValueError(f"{text!r} is not a whole number of bytes")  # (1.3GiB is rounded down to a byte)
    return check_size(int(n), repr(text), minimum=minimum)


def check_size(n: int, what: str | None = None, *, minimum: int = 1) -> int:
    """``n`` if it is a usable size (``minimum`` <= n <= MAX_SIZE), else ValueError naming ``what``."""
    shown = what or repr(n)
    if n < minimum:
        raise ValueError(f"{shown}: a size must be at least {minimum} byte{'' if minimum == 1 else 's'}")
    if n > MAX_SIZE:
        raise ValueError(f"{shown}: larger than any disk (at most {MAX_SIZE} bytes)")
    return n


USAGE_STATUS = 2  # the exit status of a refused option (argparse's own; the command line's EXIT_USAGE)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusal is one line, ``PROG: MESSAGE (see `PROG --help`)``, exit 2, with no usage block
    before it: the daemon's command line (``cli.common.Parser``) and the mlx-lm integration's options share it."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_STATUS, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def arg_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """``parse`` (``parse_size``, ``parse_duration``...) as an argparse type: its ValueError a usage error (exit 2)
    naming the option. The daemon's command line and the mlx-lm integration's options share it."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in its messages
    return convert


_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str, *, positive: bool = False) -> float:
    """'45s', '30m', '12h', '7d', '2w' (a bare number is seconds): finite and not negative (> 0 if ``positive``)."""
    if text.strip().startswith("-"):
        raise ValueError(f"{text!r}: a duration cannot be negative")
    m = _DURATION.fullmatch(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (a finite number of seconds, or e.g. 45s, 30m, 12h, 7d)")
    return check_duration(float(m.group(1)) * _SECONDS[m.group(2)], repr(text), positive=positive)


def check_duration(seconds: float, what: str | None = None, *, positive: bool = False) -> float:
    """``seconds`` if it is a usable duration (finite, >= 0, > 0 if ``positive``, at most a century), else
    ValueError naming ``what``."""
    shown = what or repr(seconds)
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_DURATION_S:
        raise ValueError(f"{shown}: a duration must be a finite number of seconds from 0 to {MAX_DURATION_S}")
    if positive and seconds == 0:
        raise ValueError(f"{shown}: must be longer than 0 s")
    return seconds


def check_block_tokens(n: int) -> int:
    """``n`` if it is a usable block size (0: entries written whole, else ``MIN_BLOCK_TOKENS`` to
    ``MAX_BLOCK_TOKENS``), else ValueError: the daemon's ``--block-tokens`` and the mlx-lm integration's."""
    if n and not MIN_BLOCK_TOKENS <= n <= MAX_BLOCK_TOKENS:
        raise ValueError(
            f"block tokens must be 0 (no blocks) or from {MIN_BLOCK_TOKENS} to {MAX_BLOCK_TOKENS}, not {n}"
        )
    return n


def check_admit_after(n: int) -> int:
    """``n`` if it is a usable write gate (0: off, up to ``MAX_ADMIT_AFTER`` asks), else ValueError: the daemon's
    ``--admit-after``, a ``Spiller``'s ``admit_after`` and the mlx-lm integration's ``--spilld-admit-after``."""
    if not 0 <= n <= MAX_ADMIT_AFTER:
        raise ValueError(f"admit after must be from 0 (off) to {MAX_ADMIT_AFTER}, not {n}")
    return n


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def default_dir() -> str:
    """The platform's cache folder: ~/Library/Caches/spilld on macOS, $XDG_CACHE_HOME/spilld elsewhere."""
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Caches/spilld")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "spilld")


SOCKET_ENV = "SPILLD_SOCKET"  # names the socket where no --socket is given: the daemon's, every command's


def default_socket() -> str:
    """``$SPILLD_SOCKET``, else inside a 0700 runtime folder: $XDG_RUNTIME_DIR/spilld on Linux, ~/Library/Application
    Support/spilld on macOS."""
    if env := os.environ.get(SOCKET_ENV):
        return env
    if sys.platform == "darwin":
        folder = os.path.expanduser("~/Library/Application Support/spilld")
    elif run := os.environ.get("XDG_RUNTIME_DIR"):
        folder = os.path.join(run, "spilld")
    else:
        folder = os.path.join("/tmp", f"spilld-{os.getuid()}")
    return os.path.join(folder, "spilld.sock")


# sun_path is 108 bytes on Linux and 104 on macOS, its terminating NUL included
MACOS_SOCKET_PATH_MAX = 103
SOCKET_PATH_MAX = MACOS_SOCKET_PATH_MAX if sys.platform == "darwin" else 107


def check_socket_path(path: str, limit: int = SOCKET_PATH_MAX) -> str:
    """An absolute socket path that fits ``sun_path``, ``limit`` bytes (a relative one is taken from the current
    folder)."""
    if not path:
        raise ValueError("the socket path is empty")
    if "\0" in path:
        raise ValueError(f"{path!r}: a socket path cannot hold a NUL byte")
    full = os.path.abspath(os.path.expanduser(path))
    n = len(os.fsencode(full))
    if n > limit:
        raise ValueError(f"socket path {full!r} is {n} bytes; a Unix socket path holds at most {limit}")
    return full


@dataclass
class Config:
    """The daemon's settings, checked when built (ValueError names the bad one): caps > 0, durations finite and
    > 0, a socket path that fits; ``dir`` and ``socket`` are made absolute."""

    cap: int = 4 * 1024**3
    disk_cap: int | None = None
    dir: str = ""
    socket: str = ""
    durability: Durability = Durability.FSYNC
    idle_timeout: float = 300.0  # a client silent this long is disconnected
    request_timeout: float = 30.0  # a frame started must be finished within this
    hello_timeout: float = 5.0
    drain_deadline: float = 60.0  # graceful stop: time to finish queued work
    max_clients: int = 512
    metrics_file: str | None = None  # a Prometheus textfile rewritten every few seconds (node_exporter's collector)
    block_tokens: int = DEFAULT_BLOCK_TOKENS  # B: tokens per prefix block (0: entries are written whole)
    write_budget: int | None = None  # bytes a day; past it droppable spills are shed (None: no budget)
    namespace_quota: int | None = None  # bytes on disk one namespace may hold (None: only the disk cap)
    pin_cap: int | None = None  # pinned bytes evicted last (None: a quarter of the disk cap)
    admit_after: int = 0  # the write gate: a droppable spill's new prefix is written once asked this often (0: off)
    warm_bytes: int = DEFAULT_WARM_BUDGET  # after a start, read this much of the newest entries ahead (0: none)
    warm_rate: int = DEFAULT_WARM_RATE  # bytes a second the read-ahead takes at most
    io_timeout: float = DEFAULT_IO_TIMEOUT_S  # seconds one storage call may take before its work fails
    scrub_rate: int = DEFAULT_SCRUB_RATE  # bytes a second the scrub checks at most (0: no scrub)
    scrub_every: float = DEFAULT_SCRUB_INTERVAL_S  # a scrub pass starts at most this often
    remote: str | None = None  # the shared tier: redis://HOST:PORT/DB, rediss://..., unix:///path (None: none)
    remote_cluster: bool = False  # the URL names a node of a Redis Cluster
    remote_push: str = "all"  # all: every entry stored with blocks; evicted: each one the disk evicts; none: fetch only
    remote_ttl: int | None = None  # seconds a pushed key lives unless used (refreshed on every fetch)
    remote_password_file: str | None = None  # else $SPILLD_REMOTE_PASSWORD (never on the command line)
    remote_key_file: str | None = None  # encrypt everything pushed (AES-GCM, a key per namespace)
    remote_host_name: str | None = None  # this daemon's name in the shared tier's events (None: the machine's)

    def __post_init__(self) -> None:
        self.dir = os.path.abspath(os.path.expanduser(self.dir or default_dir()))
        self.socket = check_socket_path(self.socket or default_socket())
        check_size(self.cap, "cap")
        if self.disk_cap is not None:
            check_size(self.disk_cap, "disk cap")
        if self.write_budget is not None:
            check_size(self.write_budget, "write budget")
        if self.pin_cap is not None:
            check_size(self.pin_cap, "pin cap", minimum=0)
        if self.namespace_quota is not None:
            check_size(self.namespace_quota, "namespace quota")
        for name in ("idle_timeout", "request_timeout", "hello_timeout", "drain_deadline", "io_timeout"):
            check_duration(getattr(self, name), name.replace("_", " "), positive=True)
        if self.metrics_file:
            self.metrics_file = os.path.abspath(os.path.expanduser(self.metrics_file))
        check_block_tokens(self.block_tokens)
        check_size(self.warm_bytes, "warm bytes", minimum=0)
        check_size(self.warm_rate, "warm rate")
        check_size(self.scrub_rate, "scrub rate", minimum=0)
        check_duration(self.scrub_every, "scrub every", positive=True)
        check_admit_after(self.admit_after)
        if self.max_clients < 1:
            raise ValueError(f"max clients must be at least 1, not {self.max_clients}")
        self._check_remote_given()

    def _check_remote_given(self) -> None:
        """A remote setting is None (not given) or a value: an empty one (``--remote-key-file "$UNSET"``) is refused,
        never taken as not given (found in review: the shared tier then ran unencrypted)."""
        for name in ("remote", "remote_password_file", "remote_key_file", "remote_host_name"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name.replace('_', ' ')} is empty (an unset variable?): leave it out for none")
        host = self.remote_host_name
        if host is not None and (not host.isprintable() or len(host.encode()) > MAX_HOST_NAME_BYTES):
            # (a router reads it as UTF-8 text; a byte argv cannot decode is a lone surrogate, not printable)
            raise ValueError(
                f"remote host name {host!r} is not printable UTF-8 text of at most {MAX_HOST_NAME_BYTES} bytes"
            )
