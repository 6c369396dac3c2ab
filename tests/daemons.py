"""Run the real daemon as a subprocess on a real Unix socket."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from spilld.config import Config


@dataclass
class Daemon:
    root: str
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> str:
        return os.path.join(self.root, "run", "spilld.sock")

    @property
    def dir(self) -> str:
        return os.path.join(self.root, "store")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "daemon.log")

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "spilld", *args], capture_output=True, text=True, timeout=timeout)

    def start(self, *extra: str, wait: bool = True) -> Daemon:
        cmd = [
            sys.executable,
            "-m",
            "spilld",
            "--dir",
            self.dir,
            "--socket",
            self.socket,
            "--log-format",
            "json",
            *self.args,
            *extra,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.read_log()}")
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.socket)
                return
            except OSError:
                time.sleep(0.05)
            finally:
                s.close()
        raise TimeoutError(f"daemon not ready:\n{self.read_log()}")

    def read_log(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def new_root() -> str:
    # short: AF_UNIX paths are limited to ~104-108 bytes
    return tempfile.mkdtemp(prefix="sd-", dir="/tmp")


def cleanup(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


@contextmanager
def serving(*args: str) -> Iterator[Daemon]:
    """A daemon subprocess in a fresh root, started with ``args``, killed and its root removed afterwards."""
    d = Daemon(new_root(), list(args)).start()
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


def quiet_config(root: str, **over: Any) -> Config:
    """An in-process daemon's settings in ``root`` (its store and socket inside it): a 64 MiB cap, no disk cap, no
    warm start, no scrub; ``over`` sets the rest (block_tokens, io_timeout, ...)."""
    base: dict[str, Any] = {
        "cap": 64 * 1024**2, "disk_cap": 2**40, "dir": os.path.join(root, "store"),
        "socket": os.path.join(root, "run", "s.sock"), "warm_bytes": 0, "scrub_rate": 0,
    }  # fmt: skip
    return Config(**(base | over))
