"""Optional encryption of everything pushed: AES-256-GCM, a key per namespace, the key of the value bound in.

A value is ``nonce (12 random bytes) || ciphertext || tag (16 bytes)``. The associated data is the value's kind
and its 32-byte key, so bytes moved under another key (or from a block to a manifest) fail to decrypt. A host
with another key file, or none, never sees plaintext, nor even the sealed values: the values a key seals are named
in a space of their own (``Sealer.tag`` in ``keys.namespace_tag``), so a value under a host's names that does not
decrypt was tampered with.
"""

from __future__ import annotations

import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .credentials import read_private_file
from .errors import DecryptError, RemoteConfigError
from .keys import Kind

NONCE_BYTES = 12  # AES-GCM's standard nonce; random per value (2^-32 collision odds only after ~2^32 values/key)
TAG_BYTES = 16
SEALED_OVERHEAD = NONCE_BYTES + TAG_BYTES  # a sealed value's bytes beyond its plaintext
AES_KEY_BYTES = 32
MAX_CACHED_NAMESPACES = 1024  # derived keys kept
MIN_KEY_FILE_BYTES = 32  # the file is the secret: at least as much entropy as the AES key it seeds
_HKDF_INFO = b"spilld-remote-aead/1\0"
_HKDF_SALT = b"spilld-remote-salt/1"
_TAG_DOMAIN = b"spilld-remote-key-tag/1\0"
KEY_TAG_HEX = 16  # hex digits of a key file's tag (in key names: which sealed space)


class Sealer:
    """Encrypts and decrypts values of the remote tier with keys derived (HKDF-SHA256) from a key file's bytes."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_FILE_BYTES:
            raise RemoteConfigError(f"the remote key file holds {len(secret)} bytes, fewer than {MIN_KEY_FILE_BYTES}")
        self._secret = secret
        self._aeads: dict[str, AESGCM] = {}
        # names the values this key seals (keys.namespace_tag): a hash of a secret of 32 bytes or more reveals nothing
        self.tag = hashlib.sha256(_TAG_DOMAIN + secret).hexdigest()[:KEY_TAG_HEX]

    @classmethod
    def from_file(cls, path: str) -> Sealer:
        """Read a key file (0600 or stricter; ``head -c 32 /dev/urandom > key`` makes one)."""
        return cls(read_private_file(path, "the remote key file"))

    def _aead(self, namespace: str) -> AESGCM:
        aead = self._aeads.get(namespace)
        if aead is None:
            if len(self._aeads) >= MAX_CACHED_NAMESPACES:
                self._aeads.clear()  # rare: more tenants than the cache; deriving again is cheap
            hkdf = HKDF(hashes.SHA256(), AES_KEY_BYTES, _HKDF_SALT, _HKDF_INFO + namespace.encode())
            aead = self._aeads[namespace] = AESGCM(hkdf.derive(self._secret))
        return aead

    def seal(self, namespace: str, key: bytes, data: bytes, kind: Kind = Kind.BLOCK) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead(namespace).encrypt(nonce, data, _aad(key, kind))

    def open(self, namespace: str, key: bytes, value: bytes, kind: Kind = Kind.BLOCK) -> bytes:
        """The plaintext of ``value``; ``DecryptError`` under another key, namespace, kind or tampered bytes."""
        if len(value) < NONCE_BYTES + TAG_BYTES:
            raise DecryptError("value shorter than a nonce and a tag")
        try:
            view = memoryview(value)  # no copy of the ciphertext
            return self._aead(namespace).decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:], _aad(key, kind))
        except InvalidTag as e:
            raise DecryptError("value does not decrypt under this host's key") from e


def _aad(key: bytes, kind: Kind) -> bytes:
    return kind.value.encode() + key
