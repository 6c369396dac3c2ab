"""Daemon settings: sizes, default folders and the socket path."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from .fileio import Durability

_UNITS = {
    "": 1,
    "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "B": 1,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G' (K/M/G/T and KiB.. are powers of 1024; KB/MB/GB/TB of 1000)."""
    m = _SIZE.match(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 2G, 10GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """'45s', '30m', '12h', '7d', '2w' (a bare number is seconds)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (examples: 30m, 12h, 7d)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


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


def default_socket() -> str:
    """Inside a 0700 runtime folder: $XDG_RUNTIME_DIR/spilld on Linux, ~/Library/Application Support/spilld on macOS."""
    if env := os.environ.get("SPILLD_SOCKET"):
        return env
    if sys.platform == "darwin":
        folder = os.path.expanduser("~/Library/Application Support/spilld")
    elif run := os.environ.get("XDG_RUNTIME_DIR"):
        folder = os.path.join(run, "spilld")
    else:
        folder = os.path.join("/tmp", f"spilld-{os.getuid()}")
    return os.path.join(folder, "spilld.sock")


@dataclass
class Config:
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

    def __post_init__(self) -> None:
        self.dir = self.dir or default_dir()
        self.socket = self.socket or default_socket()
