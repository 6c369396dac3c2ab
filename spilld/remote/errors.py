"""Errors of the remote tier. Only configuration errors reach a caller (at start-up, before anything runs);
every failure at run time is a miss and a counter."""

from __future__ import annotations


class RemoteConfigError(ValueError):
    """The remote tier's settings cannot be used: a bad URL, a password on the command line, a secret file open
    to others, a short key file."""


class DecryptError(Exception):
    """A value does not decrypt under this host's key for its namespace and key: another key, or tampered bytes."""
