"""Settings of the remote tier, every limit a named default."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from .breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD
from .errors import RemoteConfigError
from .pushqueue import DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_ITEMS

CONNECT_TIMEOUT_S = 0.1  # a LAN connect takes well under a millisecond; longer means the host is gone
# a TLS connect adds a handshake: 19-51 ms of Python and RSA on an idle 2-core VM with the context built once
TLS_CONNECT_TIMEOUT_S = 0.5
# The least bound of a socket's reads. redis-py bounds a whole reply by it, not each read (found in review: a 64 MiB
# block over a 110 MB/s link never came): a socket gets the longest call bound, and each call its own (``read_bound_s``)
SOCKET_TIMEOUT_S = 0.5
# a probe of a chain, and a lookup's read of a root or a reference: one round trip; a miss beats a stalled lookup
PROBE_TIMEOUT_S = 0.05
FETCH_TIMEOUT_S = 2.0  # pipelined GETs of a whole prefix (hundreds of megabytes at LAN speed)
PUSH_TIMEOUT_S = 2.0  # one batch of the push worker, and one event
TRIAL_TIMEOUT_S = 0.25  # the background PING that closes an open breaker
HEALTH_INTERVAL_S = 0.25  # how often the background task looks at an open breaker
PUSH_BATCH = 32  # pushes per pipeline of the worker
# and at most this many bytes per pipeline: redis-py bounds the write of a whole pipeline by the socket timeout, and
# 32 blocks of 8 MiB (an 8B model's at B = 64) never made it in 0.5 s, even over loopback, where 8 did in 0.26 s
PUSH_BATCH_BYTES = 16 * 1024**2
MAX_CONNECTIONS = 32  # per server: probes, fetches and the worker at once
# redis-py reads a reply in chunks of this many bytes: at its 64 KiB default, pipelined GETs of 8 MiB values came
# over loopback at 0.37 GB/s, at 1 MiB at 0.83-1.21 (docs/benchmarks.md, the shared tier)
SOCKET_READ_BYTES = 1024**2
EVENTS_MAXLEN = 100_000  # entries kept per events stream (XADD MAXLEN ~)
SCHEMES = ("redis", "rediss", "unix")
# The URL parameters taken (redis-py's): the database, and TLS settings that name no secret. Others are refused: a
# timeout, a pool size or a retry in the URL would override the tier's bounds (redis-py lets the URL win), and a
# secret (ssl_password) would show in the process list and the logs.
URL_PARAMS = frozenset(
    {"db", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_ca_data", "ssl_certfile", "ssl_keyfile",
     "ssl_check_hostname", "ssl_min_version"}
)  # fmt: skip


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote tier is and how long it may take. ``url``: ``redis://[user@]host:port/db``,
    ``rediss://`` (TLS), ``unix:///path``; ``cluster``: the URL names one node of a Redis Cluster."""

    url: str
    cluster: bool = False
    ttl_s: int | None = None  # set on every push and refreshed on every fetch; None: keys live until evicted
    password_file: str | None = None  # else $SPILLD_REMOTE_PASSWORD
    key_file: str | None = None  # encrypt everything pushed (AES-GCM)
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    tls_connect_timeout_s: float = TLS_CONNECT_TIMEOUT_S  # for rediss:// URLs, in place of connect_timeout_s
    socket_timeout_s: float = SOCKET_TIMEOUT_S
    probe_timeout_s: float = PROBE_TIMEOUT_S
    fetch_timeout_s: float = FETCH_TIMEOUT_S
    push_timeout_s: float = PUSH_TIMEOUT_S
    trial_timeout_s: float = TRIAL_TIMEOUT_S
    health_interval_s: float = HEALTH_INTERVAL_S
    breaker_threshold: int = DEFAULT_FAILURE_THRESHOLD
    breaker_cooldown_s: float = DEFAULT_COOLDOWN_S
    queue_items: int = DEFAULT_QUEUE_ITEMS
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    push_batch: int = PUSH_BATCH
    push_batch_bytes: int = PUSH_BATCH_BYTES
    max_connections: int = MAX_CONNECTIONS
    socket_read_bytes: int = SOCKET_READ_BYTES
    events_maxlen: int = EVENTS_MAXLEN

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "rediss"

    @property
    def tls_key_file(self) -> str | None:
        """The file holding the TLS client's private key, if the URL names one: ``ssl_keyfile``, else
        ``ssl_certfile`` (a certificate named without a key file holds the key too)."""
        if not self.tls:
            return None
        params = parse_qs(urlsplit(self.url).query)
        named = params.get("ssl_keyfile") or params.get("ssl_certfile")
        return named[0] if named else None  # (the first, as redis-py takes it)

    @property
    def connect_bound_s(self) -> float:
        """How long a new connection may take: the TCP connect, and the handshake over TLS."""
        return self.tls_connect_timeout_s if self.tls else self.connect_timeout_s

    @property
    def read_bound_s(self) -> float:
        """The socket timeout: the longest bound of a call (every call is bounded by its own as well), so that a
        reply as large as a fetch or a push may take is never cut short by the socket's."""
        return max(self.socket_timeout_s, self.fetch_timeout_s, self.push_timeout_s, self.trial_timeout_s)

    @property
    def trial_bound_s(self) -> float:
        """How long a trial PING may take: it connects first, so over TLS it has the handshake's time too."""
        return self.trial_timeout_s + (self.tls_connect_timeout_s if self.tls else 0.0)

    def check(self) -> None:
        """Raise ``RemoteConfigError`` for settings that cannot work (checked once, at start-up)."""
        check_url(self.url, self.cluster)
        if self.ttl_s is not None and self.ttl_s < 1:
            raise RemoteConfigError(f"the remote TTL is a whole number of seconds >= 1, not {self.ttl_s}")
        if (
            min(
                self.push_batch, self.push_batch_bytes, self.max_connections, self.events_maxlen, self.socket_read_bytes
            )
            < 1
        ):
            raise RemoteConfigError(
                "push_batch, push_batch_bytes, max_connections, events_maxlen and socket_read_bytes are at least 1"
            )


def check_url(url: str, cluster: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise RemoteConfigError(f"the remote URL's scheme is one of {', '.join(SCHEMES)}, not {parts.scheme!r}")
    if parts.password is not None or "password" in parse_qs(parts.query):
        raise RemoteConfigError(
            "the remote URL holds a password, which every user sees in the process list; "
            "put it in $SPILLD_REMOTE_PASSWORD or a 0600 password file"
        )
    if bad := sorted(set(parse_qs(parts.query, keep_blank_values=True)) - URL_PARAMS):
        raise RemoteConfigError(
            f"the remote URL's parameter {bad[0]!r} is not taken (only {', '.join(sorted(URL_PARAMS))}): spilld sets "
            "its own timeouts and pool, and a secret goes in a 0600 file, not the URL"
        )
    try:
        parts.port  # noqa: B018 (parsed for its check: a port that is not a number raises)
    except ValueError:
        raise RemoteConfigError(f"the remote URL's port is not a number from 0 to 65535: {parts.netloc!r}") from None
    if parts.scheme != "unix" and not parts.hostname:
        raise RemoteConfigError("the remote URL names no host (redis://HOST:PORT/DB)")
    if cluster and parts.scheme == "unix":
        raise RemoteConfigError("a Redis Cluster is reached over TCP (redis:// or rediss://), not a Unix socket")
    if cluster and (parts.path not in ("", "/", "/0") or parse_qs(parts.query).get("db", ["0"]) != ["0"]):
        raise RemoteConfigError("a Redis Cluster has one database (0): drop the /DB (or ?db=) from the URL")
    _check_values(url)


def _check_values(url: str) -> None:
    """The URL's parameter values, as the client library reads them (found in review: ``?db=x`` passed here and
    stopped the daemon at its start, after the store's scan, exit 70)."""
    try:
        from redis.connection import parse_url
    except ImportError:  # the extra is missing: the tier says so when it is made
        return
    try:
        parse_url(url)
    except ValueError as e:
        raise RemoteConfigError(f"the remote URL: {e}") from None
