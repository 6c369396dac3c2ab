"""The cold tier on disk: ``Store`` (``store.py``) over its in-memory ``Index`` (``index.py``), with the
quarantine, the pins file, the eviction order, the files to unlink, the folders and the read-only listing in
modules of their own."""

from .folders import remove_empty_folders
from .listing import EXT, list_entries, looks_like_store
from .quarantine import QUARANTINE
from .store import DEFAULT_DISK_CAP, Store, default_disk_cap

__all__ = [
    "DEFAULT_DISK_CAP",
    "EXT",
    "QUARANTINE",
    "Store",
    "default_disk_cap",
    "list_entries",
    "looks_like_store",
    "remove_empty_folders",
]
