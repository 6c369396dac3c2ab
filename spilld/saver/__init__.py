"""The saver: a generator of steps, so a driver decides when each write happens.

``save_steps`` plans the file first (no bytes materialized; hashes are
placeholders of fixed width), then yields one ``TensorStep`` per tensor and a
last ``PublishStep``. Each tensor step has two parts the driver can place
apart: ``materialize`` touches the engine's arrays (run it inside the engine's
execution lease) and ``write`` touches only bytes (hash and positional write,
fine on a worker thread). Closing the generator at any point removes the temp
file, closes the fd and drops every array reference.

One module per part: ``capture`` (what the engine's thread takes at the call), ``tensorbytes`` (a tensor's bytes,
whatever their source), ``partfile`` (the temp file until it is published), ``steps`` (the plan and the steps) and
``drive`` (running them: at once, or one per loop turn inside a lease).
"""

from .capture import (
    Attachment,
    clone_and_size,
    clone_attachments,
    clone_caches,
    evaluated,
    token_ids_now,
    token_list,
)
from .drive import WRITE_BATCH_BYTES, drive, run_step_sync, save, save_async, take_all, waits_for_grant
from .steps import (
    Encoded,
    PublishStep,
    SaveResult,
    SaveStep,
    TensorStep,
    encode_now,
    finish_plan,
    plan,
    save_steps,
)
from .tensorbytes import (
    LIVE_CHUNK_BYTES,
    LIVE_LAZY_TIMEOUT_S,
    LIVE_RETRY_S,
    AnySource,
    BytesSource,
    Staging,
    TensorBytes,
)

__all__ = [
    "LIVE_CHUNK_BYTES",
    "LIVE_LAZY_TIMEOUT_S",
    "LIVE_RETRY_S",
    "WRITE_BATCH_BYTES",
    "AnySource",
    "Attachment",
    "BytesSource",
    "Encoded",
    "PublishStep",
    "SaveResult",
    "SaveStep",
    "Staging",
    "TensorBytes",
    "TensorStep",
    "clone_and_size",
    "clone_attachments",
    "clone_caches",
    "drive",
    "encode_now",
    "evaluated",
    "finish_plan",
    "plan",
    "run_step_sync",
    "save",
    "save_async",
    "save_steps",
    "take_all",
    "token_ids_now",
    "token_list",
    "waits_for_grant",
]
