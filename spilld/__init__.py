"""spilld: a write-behind cold tier for the KV caches of local mlx engines."""

from .compat import load_prompt_cache, save_prompt_cache
from .errors import SpillError
from .fileio import Durability
from .format import GenerationCheckpoint, Header, Identity
from .identity import identity
from .lease import AsyncLockLease, IdleGate, NoLease, ThreadLockLease
from .loader import Loaded, load, read_header, verify_file
from .queue import Outcome, Settled, SpillItem, SpillQueue
from .saver import Attachment, SaveResult, clone_caches, save, save_async, save_steps
from .spiller import Spiller
from .store import Hit, Miss, MissReason, Store

__version__ = "0.1.0"

__all__ = [
    "AsyncLockLease",
    "Hit",
    "IdleGate",
    "Miss",
    "MissReason",
    "NoLease",
    "Outcome",
    "Settled",
    "SpillItem",
    "SpillQueue",
    "Spiller",
    "Store",
    "ThreadLockLease",
    "verify_file",
    "Attachment",
    "Durability",
    "GenerationCheckpoint",
    "Header",
    "Identity",
    "Loaded",
    "SaveResult",
    "SpillError",
    "clone_caches",
    "identity",
    "load",
    "load_prompt_cache",
    "read_header",
    "save",
    "save_async",
    "save_prompt_cache",
    "save_steps",
]
