"""Real ``redis-server`` processes for the remote-tier tests: one server, or a 3-master Redis Cluster, on free
localhost ports, in a temporary folder, killed at teardown. No mock, no fake client."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
START_TIMEOUT_S = 10.0
CLUSTER_TIMEOUT_S = 30.0
CLUSTER_BUS_OFFSET = 10000  # Redis Cluster's bus listens on port + 10000


def free_port() -> int:
    """A localhost port free now, whose cluster bus port is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + CLUSTER_BUS_OFFSET < 65536 and _free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_pingable(proc: subprocess.Popen[bytes], client: Callable[[], redis.Redis], log: Callable[[], str]) -> None:
    """Until a new ``client()`` answers PING from ``proc`` itself; the server's ``log()`` if it exits first. (Another
    test run's server may hold the port a moment before ours fails to bind it: its answer is not ours.)"""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, log()
        try:
            with client() as c:
                if int(c.info("server")["process_id"]) == proc.pid:
                    return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"another server answers on our port: {log()}"
        time.sleep(0.02)


@dataclass
class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``args`` are extra config options (``["--requirepass", "pw"]``)."""

    args: list[str] = field(default_factory=list)
    password: str | None = None
    port: int = 0
    dir: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS_SERVER, "redis-server is not installed (scripts/test.sh installs it)"
        self.port = self.port or free_port()
        self.dir = self.dir or tempfile.mkdtemp(prefix="spilld-redis-")
        extra = ["--requirepass", self.password] if self.password else []
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log"), *extra, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()
        return self

    def client(self) -> redis.Redis:
        """A plain synchronous client, to look at what the tier wrote."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def wait_ready(self) -> None:
        assert self.proc is not None
        wait_pingable(self.proc, self.client, self.log)

    def log(self) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.dir, "redis.log")) as f:
            return f.read()[-4000:]
        return ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap (the port is then free for a restart)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies on SIGKILL too; this is for its peers
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> RedisServer:
        """Killed and started again on the same port: empty, as after a crash without persistence."""
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.kill()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(*args: str, password: str | None = None) -> Iterator[RedisServer]:
    server = RedisServer(list(args), password)
    try:
        yield server.start()
    finally:
        server.cleanup()


def self_signed(folder: str, name: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made with openssl (``cert``, ``key`` paths)."""
    cert, key = os.path.join(folder, f"{name}.pem"), os.path.join(folder, f"{name}.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@dataclass
class TLSServer:
    """A ``redis-server`` that speaks TLS only, on a self-signed certificate (``cert``)."""

    port: int
    cert: str
    other_cert: str  # a second self-signed certificate: a client that trusts only it distrusts the server

    def url(self, ca: str) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"


@contextlib.contextmanager
def tls_redis_server() -> Iterator[TLSServer]:
    folder = tempfile.mkdtemp(prefix="spilld-redis-tls-")
    cert, key = self_signed(folder, "server")
    other, _ = self_signed(folder, "other")
    port = free_port()
    assert REDIS_SERVER, "redis-server is not installed (scripts/test.sh installs it)"
    cmd = [REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", cert,
           "--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no", "--save", "",
           "--appendonly", "no", "--dir", folder]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = TLSServer(port, cert, other)
    try:
        wait_pingable(proc, lambda: redis.Redis.from_url(server.url(cert), socket_timeout=2), lambda: "")
        yield server
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Cluster:
    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def dbsizes(self) -> list[int]:
        sizes = []
        for n in self.nodes:
            with n.client() as c:
                sizes.append(int(c.dbsize()))
        return sizes


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[Cluster]:
    """A Redis Cluster of ``masters`` masters and no replicas, every slot covered, ``cluster_state:ok``."""
    opts = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
    nodes = [RedisServer(list(opts)) for _ in range(masters)]
    try:
        for n in nodes:
            n.start()
        assert REDIS_CLI, "redis-cli is not installed (scripts/test.sh installs it)"
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        cmd = [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S)
        assert r.returncode == 0, r.stdout + r.stderr
        _wait_cluster_ok(nodes)
        yield Cluster(nodes)
    finally:
        for n in nodes:
            n.cleanup()


def _wait_cluster_ok(nodes: list[RedisServer]) -> None:
    deadline = time.monotonic() + CLUSTER_TIMEOUT_S
    while True:
        states = []
        for n in nodes:
            with n.client() as c:
                states.append(c.cluster("info").get("cluster_state"))
        if all(s == "ok" for s in states):
            return
        assert time.monotonic() < deadline, f"cluster not ok: {states}"
        time.sleep(0.05)
