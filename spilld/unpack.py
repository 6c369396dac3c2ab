"""msgpack decoding with a bound on the objects it makes: every message a client sends and every file header is
hostile until checked, and msgpack's empty maps and arrays cost 64-72 bytes of Python objects for one byte each.

``unpack`` counts maps and arrays as they are made and stops at one per ``BYTES_PER_CONTAINER`` bytes of input
(plus ``CONTAINER_SLACK``), so the objects of a decoded message stay within ``MAX_EXPANSION`` times its size
(measured worst cases, CPython 3.11: an array of negative fixints 42.8x, each a new int (CPython caches -5..256
only) and a list slot per byte; of one-character UCS-2 strings 30x; of empty maps 72.5x, of empty arrays 64.5x:
``tests/test_protocol.py``). What spilld sends and writes has one container per ~30 bytes or more (a tensor's map
and its shape).

Such input is decoded in slices of ``SLICE_BYTES``, one C call each: a thread decoding a hostile message (the
daemon's, off its event loop) lets the others run between two slices, where one ``unpackb`` of 4 MiB of small
negative ints held the interpreter's lock for 0.12 s.
"""

from __future__ import annotations

from typing import Any

import msgpack

BYTES_PER_CONTAINER = 16  # at most one map or array per this many bytes of input
CONTAINER_SLACK = 64  # and this many more, so a short message of a few small maps is never refused
MAX_EXPANSION = 48  # bytes of objects per byte of input, at most: 43 for scalars + 72.5 / BYTES_PER_CONTAINER
# and for input not counted (under COUNT_FROM_BYTES): an array of empty maps, 72.5x (the measured worst case)
MAX_UNCOUNTED_EXPANSION = 73
# Input shorter than this is decoded without counting: at most ~4.6 MiB of objects, and the count's own cost (a
# call per map or array: +80 us on a block file's 7 KiB header, read for every block a restore loads) is saved
COUNT_FROM_BYTES = 64 * 1024
SLICE_BYTES = 64 * 1024  # counted input is decoded this many bytes per C call (~2 ms), the others let run between


class TooManyContainers(ValueError):
    """More maps and arrays than the input's size allows."""


def container_limit(nbytes: int) -> int:
    return nbytes // BYTES_PER_CONTAINER + CONTAINER_SLACK


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """``msgpack.unpackb`` (text as str, arrays as lists, map keys str or bytes), refusing input of
    ``COUNT_FROM_BYTES`` or more with more maps and arrays than ``container_limit`` of its size: raises
    ``TooManyContainers`` (a ValueError) or msgpack's own errors for input that is not msgpack."""
    if len(data) < COUNT_FROM_BYTES:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    left = container_limit(len(data))

    def counted(obj: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise TooManyContainers(f"more than {container_limit(len(data))} maps and arrays in {len(data)} bytes")
        return obj

    n = len(data)
    # (the limits unpackb derives from the input's size: the same here, through the buffer's)
    u = msgpack.Unpacker(
        raw=False, strict_map_key=True, use_list=True, list_hook=counted, object_hook=counted, max_buffer_size=n
    )
    view = memoryview(data).cast("B")
    for at in range(0, n, SLICE_BYTES):
        u.feed(view[at : at + SLICE_BYTES])
        try:
            obj = u.unpack()  # the unpacker keeps a partial object's state from one slice to the next
        except msgpack.OutOfData:
            continue
        if u.tell() != n:
            raise msgpack.ExtraData(obj, bytes(view[u.tell() :]))
        return obj
    raise ValueError("Unpack failed: incomplete input")
