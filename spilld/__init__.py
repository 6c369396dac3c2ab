"""spilld: a write-behind cold tier for the KV caches of local mlx engines.

The names here are what an engine uses: the three ways in (``Spiller`` in-process, ``AsyncClient`` and ``Client``
to the daemon), the model identity, the leases, the typed results, the one-file ``save``/``load`` and mlx-lm's
drop-ins, and the base of every error. Everything else stays in its module (``spilld.store.Store``,
``spilld.saver.save_steps``, ...).

Nothing is imported until it is used, so ``import spilld.protocol`` (or the daemon) never loads mlx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it; imported on first use (PEP 562)
_HOMES: dict[str, str] = {
    "AsyncClient": "client",
    "AsyncLockLease": "lease",
    "Attachment": "saver",
    "Client": "client",
    "DrainReport": "queue",
    "FairLock": "lease",
    "GenerationCheckpoint": "format",
    "Hit": "api",
    "Identity": "format",
    "IdleGate": "lease",
    "Loaded": "loader",
    "Miss": "api",
    "NoLease": "lease",
    "Outcome": "queue",
    "Settled": "queue",
    "SpillError": "errors",
    "Spiller": "spiller",
    "ThreadLockLease": "lease",
    "load": "loader",
    "load_prompt_cache": "compat",
    "model_identity": "identity",
    "save": "saver",
    "save_prompt_cache": "compat",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:  # the same names, for type checkers (the redundant aliases mark them re-exported)
    from .api import Hit as Hit
    from .api import Miss as Miss
    from .client import AsyncClient as AsyncClient
    from .client import Client as Client
    from .compat import load_prompt_cache as load_prompt_cache
    from .compat import save_prompt_cache as save_prompt_cache
    from .errors import SpillError as SpillError
    from .format import GenerationCheckpoint as GenerationCheckpoint
    from .format import Identity as Identity
    from .identity import model_identity as model_identity
    from .lease import AsyncLockLease as AsyncLockLease
    from .lease import FairLock as FairLock
    from .lease import IdleGate as IdleGate
    from .lease import NoLease as NoLease
    from .lease import ThreadLockLease as ThreadLockLease
    from .loader import Loaded as Loaded
    from .loader import load as load
    from .queue import DrainReport as DrainReport
    from .queue import Outcome as Outcome
    from .queue import Settled as Settled
    from .saver import Attachment as Attachment
    from .saver import save as save
    from .spiller import Spiller as Spiller


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'spilld' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
