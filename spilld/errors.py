"""Typed errors. Each class has a stable ``code`` string that can cross a socket.

Codes never change once released; ``error_from_code`` rebuilds the typed error on
the other side of a connection.
"""

from __future__ import annotations

import os


class SpillError(Exception):
    """Base of every error spilld raises on purpose."""

    code = "error"

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.reason = message
        super().__init__(f"{self.path}: {message}" if self.path else message)


# --- file format: the bytes on disk are not a valid spilld file ---------------


class FileFormatError(SpillError):
    """The file is not a valid spilld file (corrupt, truncated or foreign)."""

    code = "bad_file"


class BadMagic(FileFormatError):
    code = "bad_magic"


class UnsupportedVersion(FileFormatError):
    code = "unsupported_version"


class TruncatedFile(FileFormatError):
    code = "truncated"


class HeaderTooLarge(FileFormatError):
    code = "header_too_large"


class HeaderHashMismatch(FileFormatError):
    code = "header_hash_mismatch"


class HeaderMalformed(FileFormatError):
    code = "header_malformed"


class PaddingNotZero(FileFormatError):
    code = "padding_not_zero"


class TooManyTensors(FileFormatError):
    code = "too_many_tensors"


class RankTooLarge(FileFormatError):
    code = "rank_too_large"


class DimensionTooLarge(FileFormatError):
    code = "dimension_too_large"


class TotalSizeTooLarge(FileFormatError):
    code = "total_size_too_large"


class TooManyTokens(FileFormatError):
    code = "too_many_tokens"


class NestingTooDeep(FileFormatError):
    code = "nesting_too_deep"


class LayoutError(FileFormatError):
    """Tensor slots are misaligned, overlap, leave holes or disagree with the file length."""

    code = "bad_layout"


class TensorHashMismatch(FileFormatError):
    code = "tensor_hash_mismatch"


class CheckpointInconsistent(FileFormatError):
    code = "checkpoint_inconsistent"


# --- header rules (spilld/validate.py): the header contradicts itself or its codec ---
# Each one is a HeaderMalformed, so code that catches that keeps working.


class VersionMismatch(HeaderMalformed):
    """The header's ``format`` differs from the prefix's version (or, for a spill, the daemon's)."""

    code = "version_mismatch"


class SlotSizeMismatch(LayoutError):
    """A slot's ``bytes`` differs from item size x product of its shape."""

    code = "slot_size_mismatch"


class TensorCountMismatch(HeaderMalformed):
    code = "tensor_count_mismatch"


class TensorRankMismatch(HeaderMalformed):
    code = "tensor_rank_mismatch"


class DtypeNotAllowed(HeaderMalformed):
    code = "dtype_not_allowed"


class ShapeMismatch(HeaderMalformed):
    """Tensors of one entry disagree (batch, heads, rows, or a packed width with its scales)."""

    code = "shape_mismatch"


class FieldInvalid(HeaderMalformed):
    """A codec field is missing, of the wrong type or out of its range."""

    code = "field_invalid"


class QuantizationInvalid(HeaderMalformed):
    """``bits`` or ``group_size`` is not one mlx supports."""

    code = "quantization_invalid"


class OffsetMismatch(HeaderMalformed):
    """An entry's ``offset`` (or ``min_reusable``, ``trimmable``) disagrees with its live rows or children."""

    code = "offset_mismatch"


class OffsetBeyondTokens(HeaderMalformed):
    """An entry encodes more tokens than the file records."""

    code = "offset_beyond_tokens"


class IndexOutOfRange(HeaderMalformed):
    """A ring or batch write index (``idx``) points past the rows stored."""

    code = "index_out_of_range"


class KindNotInProvider(HeaderMalformed):
    """The file names a provider whose fixed table has no such kind: a bad file, not a newer one."""

    code = "kind_not_in_provider"


class BlockInvalid(HeaderMalformed):
    """A v2 manifest's or block's block fields contradict the file (sizes, counts, layout)."""

    code = "block_invalid"


class BlockKeyMismatch(HeaderMalformed):
    """A block's key is not the SHA-256 of its parent key and its token ids (or not the key a manifest names)."""

    code = "block_key_mismatch"


class BlockMissing(FileFormatError):
    """A manifest names a block that is not on disk: the manifest cannot be served."""

    code = "block_missing"


class CapacityTooLarge(HeaderMalformed):
    """A load would grow a tensor by more than one capacity step (a codec bug; never a file's choice)."""

    code = "capacity_too_large"


# --- compatibility: a valid file that this reader must not use -----------------


class IdentityMismatch(SpillError):
    """The file was written for another model, tokenizer or namespace."""

    code = "identity_mismatch"


class CodecProviderMismatch(SpillError):
    code = "codec_provider_mismatch"


class UnknownCacheKind(SpillError):
    code = "unknown_cache_kind"


class CodecVersionUnsupported(SpillError):
    code = "codec_version_unsupported"


class UnsupportedCache(SpillError):
    """No registered codec can save this cache object."""

    code = "unsupported_cache"


class NotReusable(SpillError):
    """The entry cannot be cut back to the requested prefix length."""

    code = "not_reusable"


# --- saving -----------------------------------------------------------------


class SaveAborted(SpillError):
    """The save was closed, cancelled or its lease failed; nothing was published."""

    code = "save_aborted"


class PlanDrift(SpillError):
    """A tensor or the header changed size between the plan and the write."""

    code = "plan_drift"


class Shed(SpillError):
    """A droppable spill the store chose not to write (its outcome is DROPPED, not FAILED)."""

    code = "shed"


class WriteBudgetSpent(Shed):
    """The store's write budget for the last 24 hours is spent: droppable spills are not written."""

    code = "write_budget_spent"


class HeldBlockGone(SpillError):
    """A block the daemon told the client it held (so its rows were not sent) was gone when the spill was
    written (found corrupt and quarantined: evictions leave such blocks until the spill is written): the spill
    fails; the engine's next spill sends those rows again."""

    code = "held_block_gone"


class NotAdmitted(Shed):
    """The write gate (``--admit-after``): the spill's new prefix was not asked for often enough to be written."""

    code = "not_admitted"


class StorageError(SpillError):
    """An I/O error while writing or reading (errno kept in ``errno``)."""

    code = "io_error"

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, errno: int | None = None) -> None:
        self.errno = errno
        super().__init__(message, path=path)


class StorageTimeout(StorageError):
    """A storage call did not return within its deadline (``--io-timeout``): a hung or failing disk. The work
    is abandoned (its thread left to end on its own), never waited for."""

    code = "io_timeout"


class DiskFull(StorageError):
    code = "disk_full"


# --- running: where and beside whom a daemon may run ----------------------------------


class AlreadyRunning(SpillError):
    """Another spilld holds the folder or the socket (its lock file names the pid)."""

    code = "already_running"


class UnusableFolder(SpillError):
    """A folder spilld was given cannot be used safely: not writable, not a folder, or open to other users."""

    code = "unusable_folder"


class ForeignDaemon(SpillError):
    """What answers on the socket runs as another user: nothing is sent to it."""

    code = "foreign_daemon"


# --- the wire and the daemon: codes a client process must rebuild as their own classes ----------


class ProtocolError(SpillError):
    """The peer broke the protocol (a malformed or oversized frame); the connection is closed."""

    code = "protocol_error"


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class Busy(SpillError):
    """The daemon cannot take this now (its queue is full of items it may not drop, too many clients, or it is
    stopping); wait and retry. Not a lost connection: the daemon is there and said no."""

    code = "busy"


class UnknownMethod(SpillError):
    code = "unknown_method"


class BadParams(SpillError, ValueError):
    code = "bad_params"


class UnsupportedProtocol(SpillError):
    code = "unsupported_protocol"


class DuplicateHello(SpillError):
    """A second ``hello`` on a connection: refused; the first one's settings stay."""

    code = "duplicate_hello"


class ConnectionLost(SpillError, ConnectionError):
    """The daemon cannot be reached, or the connection ended before an answer came."""

    code = "connection_lost"


class NotADaemon(ConnectionLost):
    """What answers on the socket is not a spilld daemon: its answer to the hello broke the protocol (an HTTP
    server's reply read as a frame's length, say). A daemon that cannot be reached, as far as a command goes."""

    code = "not_a_daemon"


class Closed(ConnectionLost):
    """A ``Spiller`` or a client used after its ``close``, or a queue closed under an item (a stop): the same error
    on every way in. A ``ConnectionLost``: to an engine, a tier it can no longer reach."""

    code = "closed"


class NotStarted(SpillError, RuntimeError):
    """A ``Spiller`` or ``AsyncClient`` used before ``open`` (or ``async with``): the same error on both ways in."""

    code = "not_started"


class Timeout(SpillError, TimeoutError):
    """No answer within the call's deadline."""

    code = "timeout"


class PeerRefused(SpillError, PermissionError):
    """The daemon serves only its own user: the peer's uid is not the daemon's."""

    code = "peer_refused"


class LeaseRefused(SpillError):
    """A lease grantor answered the daemon's ``lease`` request with an error (its engine's lease failed). Its code
    and message are only quoted: a client's word is never taken as the daemon's own error (a ``disk_full`` from a
    client made the store evict everyone's entries)."""

    code = "lease_refused"


class ActivationError(SpillError):
    """A service manager handed us something that is not a listening Unix stream socket."""

    code = "activation_error"


class ShmRefused(SpillError):
    """A shared-memory segment named by a client cannot be used."""

    code = "shm_refused"


class StopSignal(BaseException):
    """SIGTERM or SIGHUP during a command that must clean up before it ends (``spilld demo`` stops the daemon it
    started): raised where the command is, like ``KeyboardInterrupt`` (no ``except Exception`` swallows it); the
    command exits 128 + the signal's number, as a process killed by it would. Not a ``SpillError``: never sent."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by signal {signum}")


def _all_subclasses(cls: type[SpillError]) -> list[type[SpillError]]:
    out: list[type[SpillError]] = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def _by_code(classes: list[type[SpillError]]) -> dict[str, type[SpillError]]:
    out: dict[str, type[SpillError]] = {}
    for c in classes:
        if out.setdefault(c.code, c) is not c:
            raise RuntimeError(f"error code {c.code!r} names both {out[c.code].__name__} and {c.__name__}")
    return out


# Every code is defined in this module, so a process that imports only this one rebuilds every error a daemon sends.
# A subclass defined elsewhere is not added here: its code would map differently depending on what was imported.
ERRORS_BY_CODE: dict[str, type[SpillError]] = _by_code(_all_subclasses(SpillError))


def error_from_code(code: str, message: str) -> SpillError:
    """Rebuild a typed error from its stable code (unknown codes give ``SpillError``)."""
    cls = ERRORS_BY_CODE.get(code, SpillError)
    err = cls.__new__(cls)
    SpillError.__init__(err, message)
    return err
