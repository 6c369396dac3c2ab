"""Sizes, durations and default paths."""

from __future__ import annotations

import math
from typing import Any

import pytest

from spilld.config import default_dir, default_socket, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("4GiB", 4 * 1024**3), ("512MiB", 512 * 1024**2), ("2G", 2 * 1024**3), ("10GB", 10 * 1000**3),
        ("1K", 1024), ("1KB", 1000), ("3T", 3 * 1024**4), ("1TB", 1000**4), ("123", 123), ("1.5GiB", 3 * 1024**3 // 2),
        ("64 mib", 64 * 1024**2),
    ],
)  # fmt: skip
def test_sizes(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "text",
    [
        "", "GiB", "4 parsecs", "-1G", "4GiBs", "1e9", "4 G B", "9" * 400, "99999999999T",
        "1.5B", "2.5", "\uff14GiB",  # found in review: 1.5B was 1 byte, and fullwidth digits passed
    ],
)  # fmt: skip
def test_bad_sizes_are_usage_errors(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_durations() -> None:
    assert parse_duration("45s") == 45 and parse_duration("30m") == 1800 and parse_duration("7d") == 7 * 86400
    assert parse_duration("12") == 12
    for bad in ("soon", "\uff11s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_format_size() -> None:
    assert format_size(512) == "512 B" and format_size(4 * 1024**3) == "4.0 GiB"


def test_default_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/c")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    monkeypatch.delenv("SPILLD_SOCKET", raising=False)
    import sys

    if sys.platform != "darwin":
        assert default_dir() == "/c/spilld"
        assert default_socket() == "/run/user/7/spilld/spilld.sock"
        monkeypatch.delenv("XDG_RUNTIME_DIR")
        assert default_socket().startswith("/tmp/spilld-")
    monkeypatch.setenv("SPILLD_SOCKET", "/x.sock")
    assert default_socket() == "/x.sock"


@pytest.mark.parametrize("text", ["-5", "nan", "inf", "-1s", "1e3", "5 parsecs"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_zero_is_a_duration_but_not_a_positive_one_nor_a_cap() -> None:
    assert parse_duration("0") == 0
    with pytest.raises(ValueError):
        parse_duration("0", positive=True)
    with pytest.raises(ValueError):
        parse_size("0")
    with pytest.raises(ValueError):
        parse_size("0.5")  # rounds to 0 bytes


def test_config_checks_every_value(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from spilld.config import SOCKET_PATH_MAX, Config

    sock = str(tmp_path / "s.sock")
    for bad in (
        {"cap": 0},
        {"disk_cap": 0},
        {"drain_deadline": -5.0},
        {"drain_deadline": math.nan},
        {"idle_timeout": -1.0},
        {"idle_timeout": math.inf},
        {"max_clients": 0},
        {"socket": "/tmp/" + "s" * SOCKET_PATH_MAX},
    ):
        with pytest.raises(ValueError):
            Config(**{"socket": sock, "dir": str(tmp_path), **bad})
    monkeypatch.chdir(tmp_path)
    cfg = Config(socket="s.sock", dir="store")  # relative: taken from the current folder
    assert cfg.socket == sock and cfg.dir == str(tmp_path / "store")


def test_a_remote_host_name_is_printable_utf8_of_at_most_max_host_name_bytes(tmp_path: Any) -> None:
    """``--remote-host-name`` goes in every event a router reads as UTF-8 text: a name with a control character, one
    that is not UTF-8 (argv's bytes that do not decode come as lone surrogates) or one longer than
    ``MAX_HOST_NAME_BYTES`` is refused at start, never an event that fails to encode or to read."""
    from spilld.config import MAX_HOST_NAME_BYTES, Config

    sock = str(tmp_path / "s.sock")
    for good in ("gpu-0", "a" * MAX_HOST_NAME_BYTES, "hôte"):
        assert Config(socket=sock, remote="redis://h:1/0", remote_host_name=good).remote_host_name == good
    for bad in ("a" * (MAX_HOST_NAME_BYTES + 1), "é" * (MAX_HOST_NAME_BYTES // 2 + 1), "gpu\n0", "\udcff"):
        with pytest.raises(ValueError, match="remote host name"):
            Config(socket=sock, remote="redis://h:1/0", remote_host_name=bad)


def test_the_remote_ttl_is_a_duration_in_whole_seconds() -> None:
    # README: every duration goes through one parser; Redis takes a TTL in whole seconds, so it is rounded up
    from spilld.cli.parser import build_parser

    def ttl(text: str) -> Any:
        return build_parser().parse_args(["serve", "--remote-ttl", text]).remote_ttl

    assert ttl("7d") == 7 * 86400 and ttl("3600") == 3600 and ttl("1.2") == 2 and ttl("0.5") == 1
    assert build_parser().parse_args(["serve"]).remote_ttl is None
    for bad in ("0", "-5", "soon"):
        with pytest.raises(SystemExit) as exc:
            ttl(bad)
        assert exc.value.code == 2
