"""The remote tier (issue 15): blocks and manifests shared by every host through Redis, Valkey or a Redis
Cluster. Needs the optional extra ``spilld[remote]`` (redis, cryptography); nothing else in spilld imports it
unless ``--remote`` is given.

The pieces: ``keys`` (the key scheme), ``breaker`` (a circuit breaker), ``crypto`` (AES-GCM per namespace),
``credentials`` (password and key files), ``pushqueue`` (the droppable write-behind queue), ``tier``
(``RemoteTier``: probe, fetch, push, events), ``link`` (``RemoteLink``: the store's listener that pushes, and the fill
a daemon lookup asks for), ``router`` (an example router reading the hosts' events).
"""

from __future__ import annotations

from .config import RemoteConfig
from .errors import DecryptError, RemoteConfigError
from .keys import Kind
from .stats import Reason
from .tier import EventKind, RemoteTier

__all__ = ["DecryptError", "EventKind", "Kind", "Reason", "RemoteConfig", "RemoteConfigError", "RemoteTier"]
