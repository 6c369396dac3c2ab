"""The Redis key scheme of the remote tier.

Every key sits under ``spilld:1:<namespace tag>:``, so one ACL pattern per tenant (``~spilld:1:<tag>:*``)
grants a tenant its own blocks, manifests and events and nothing else. No hash tag (``{...}``) is used: a
cluster spreads one namespace's blocks over all its masters.
"""

from __future__ import annotations

import functools
import hashlib
from enum import StrEnum

KEY_PREFIX = "spilld"
SCHEME_VERSION = 1  # bump when a key's meaning changes: old and new daemons then never read each other's keys
NS_TAG_HEX = 16  # hex digits of the namespace tag: 64 bits, ample for the tenants of one Redis
BLOCK_KEY_BYTES = 32  # a block key is a SHA-256 (blocks.next_key)
_NS_DOMAIN = b"spilld-remote-ns/1\0"
# A sealed space (``key_tag``: a key file's, ``Sealer.tag``): hosts with another key file, or none, name their values
# elsewhere, so a value one host cannot open is never another's that it may not read: it is bad bytes
_SEALED_DOMAIN = b"spilld-remote-sealed-ns/1\0"


class Kind(StrEnum):
    """What a value under a key is: one letter in the key, so a block and a manifest never share one."""

    BLOCK = "b"
    MANIFEST = "m"  # under the key of the last block it names
    REF = "p"  # under a block's key: the key of a manifest naming it (32 bytes), for blocks-only restores
    ROOT = "r"  # under a layout space's key: the root key of its chains (``link.root_space``)


@functools.lru_cache(maxsize=1024)  # every key of a lookup's chain names its namespace: hashed once
def namespace_tag(namespace: str, key_tag: str | None = None) -> str:
    """The hex tag of a namespace in every key: SHA-256, since tags are shared by hosts and tenants. With
    ``key_tag``, the tag of that namespace's sealed space (the hosts sharing that key file)."""
    domain = _NS_DOMAIN if key_tag is None else _SEALED_DOMAIN + key_tag.encode() + b"\0"
    return hashlib.sha256(domain + namespace.encode()).hexdigest()[:NS_TAG_HEX]


def namespace_prefix(namespace: str, key_tag: str | None = None) -> str:
    """The prefix of every key of one namespace (what a tenant's ACL pattern names, ``*`` appended)."""
    return f"{KEY_PREFIX}:{SCHEME_VERSION}:{namespace_tag(namespace, key_tag)}:"


def value_key(namespace: str, key: bytes, kind: Kind = Kind.BLOCK, key_tag: str | None = None) -> str:
    """The Redis key of a block (or a manifest) named by its 32-byte key."""
    if len(key) != BLOCK_KEY_BYTES:
        raise ValueError(f"a block key has {BLOCK_KEY_BYTES} bytes, not {len(key)}")
    return f"{namespace_prefix(namespace, key_tag)}{kind.value}:{key.hex()}"


def block_key(namespace: str, key: bytes, key_tag: str | None = None) -> str:
    return value_key(namespace, key, Kind.BLOCK, key_tag)


def manifest_key(namespace: str, key: bytes, key_tag: str | None = None) -> str:
    return value_key(namespace, key, Kind.MANIFEST, key_tag)


def events_key(namespace: str, key_tag: str | None = None) -> str:
    """The stream of one namespace's "prefix stored" and "prefix evicted" events."""
    return f"{namespace_prefix(namespace, key_tag)}events"


def acl_pattern(namespace: str, key_tag: str | None = None) -> str:
    """The key pattern of one tenant, for ``ACL SETUSER <user> on >password ~<pattern> +@read +@write`` (with a
    key file, its ``Sealer.tag``: ``spilld.remote.Sealer.from_file(path).tag``)."""
    return namespace_prefix(namespace, key_tag) + "*"
