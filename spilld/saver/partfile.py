"""The temp file a save writes (``PartFile``): opened on its first write, published by a rename once durable,
removed unless published."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .. import directio, fileio
from ..fileio import Durability, FileOps, temp_path_for


class PartFile:
    """The temp file being written: opened on the first write, removed unless published."""

    def __init__(
        self, path: str, size: int, durability: Durability, ops: FileOps, direct: bool, sync_folder: bool = True
    ) -> None:
        self.path = path
        self.sync_folder = sync_folder  # False: the caller syncs the folder once for several files
        self.temp = temp_path_for(path)
        self.size = size
        self.durability = durability
        self.ops = ops
        self.fd: int | None = None
        self.renamed = False  # the final name exists
        self.published = False  # ... and is durable: the save succeeded
        self.want_direct = direct and bool(directio.O_DIRECT)
        self.direct: directio.DirectWriter | None = None

    def ensure_open(self) -> int:
        if self.fd is None:
            if self.want_direct:
                try:
                    self.fd = self.ops.open_new(self.temp, directio.O_DIRECT)
                    self.direct = directio.DirectWriter(self.fd, self.temp, self.ops)
                except OSError:  # a filesystem without O_DIRECT (tmpfs): buffered writes
                    self.want_direct = False
                    self.fd = None
                    fileio.remove_quietly(self.ops, self.temp)  # some kernels create the file before refusing
            if self.fd is None:
                with fileio.io_errors("create", self.temp):
                    self.fd = self.ops.open_new(self.temp)
            fileio.preallocate(self.ops, self.fd, self.size, self.temp)
        return self.fd

    def write(self, bufs: Sequence[memoryview], offset: int) -> None:
        fd = self.ensure_open()
        if self.direct is not None:
            self.direct.write(bufs, offset)
        else:
            fileio.write_all(self.ops, fd, bufs, offset, self.temp)

    def publish(self, head: bytes) -> None:
        fd = self.ensure_open()
        if self.direct is not None:
            self.direct.write([memoryview(head)], 0)
            self.direct.flush()
            self.direct.close()
            with fileio.io_errors("truncate", self.temp):
                self.ops.ftruncate(fd, self.size)  # the last block's padding may run past the end
        else:
            fileio.write_all(self.ops, fd, [memoryview(head)], 0, self.temp)
        fileio.sync(self.ops, fd, self.durability, self.temp)
        self.fd = None
        with fileio.io_errors("close", self.temp):
            self.ops.close(fd)
        with fileio.io_errors("rename", self.path):
            self.ops.rename(self.temp, self.path)
        self.renamed = True
        if self.sync_folder:
            fileio.sync_dir(self.ops, os.path.dirname(self.path), self.durability)
        self.published = True

    def abort(self, abandoned: bool = False) -> None:
        """Close the file and remove it unless published; ``abandoned``: the save's caller never took its result
        (its publish landed after the caller gave up), so a published name goes too."""
        if self.direct is not None:
            self.direct.close()  # no write may land on a closed (or reused) fd
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                self.ops.close(fd)
            except OSError:
                pass  # a failed fd is never fsynced or reused
        if not self.published or abandoned:  # a save that fails after its rename takes its name back
            fileio.remove_quietly(self.ops, self.path if self.renamed else self.temp)
