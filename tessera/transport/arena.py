"""A memory node's block arena: a named POSIX shared-memory segment of fixed-size slots.

    | arena header (4 KiB) | slot 0 | slot 1 | ... | slot capacity-1 |

The header names the owner (pid, boot id) and the slot geometry so that a same-host reader
that maps the segment (the ``shm`` transport) can check it is looking at the incarnation it
expects and that the owner is still alive. Slots are page-aligned when the slot size is a
multiple of 4 KiB, and always 64-byte aligned.

The arena holds payload bytes only; which slot belongs to which unit is decided by the
control plane's allocator, never here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import struct
from pathlib import Path

from tessera.errors import ConfigError, TransferError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
ARENA_MAGIC = b"TKVARENA"
ARENA_VERSION = 1
ARENA_HEADER_BYTES = 4096
# magic, version, owner pid, boot id (hex, 32 chars), slot bytes, capacity
_HEADER = struct.Struct("<8sII32sQQ")


SEGMENT_PREFIX = "tessera-"


def segment_name(node: str, boot_id: str) -> str:
    return f"{SEGMENT_PREFIX}{node}-{boot_id[:12]}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class Arena:
    """One mapped segment. ``create`` is the memory node's side; ``attach`` a reader's."""

    def __init__(self, name: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self._mm = mm
        self._owner = owner
        self._closed = False
        magic, version, pid, boot, slot_bytes, capacity = _HEADER.unpack_from(mm, 0)
        if magic != ARENA_MAGIC or version != ARENA_VERSION:
            mm.close()
            os.close(fd)
            raise TransferError(f"shared memory segment {name} is not a tessera arena (magic {magic!r})")
        os.close(fd)  # the mapping keeps the segment alive
        self.pid: int = pid
        self.boot_id: str = boot.decode()
        self.slot_bytes: int = slot_bytes
        self.capacity: int = capacity
        self.view = memoryview(mm)
        # an exported pointer for engines that need a raw address (Mooncake registration)
        self._anchor: ctypes.c_char | None = None

    # --- lifecycle -----------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, slot_bytes: int, capacity: int, boot_id: str) -> Arena:
        """Create, size and commit the segment; refuse with ConfigError if it cannot be allocated."""
        assert slot_bytes % 64 == 0 and capacity > 0, (slot_bytes, capacity)
        size = ARENA_HEADER_BYTES + slot_bytes * capacity
        if not SHM_DIR.is_dir():
            raise ConfigError(f"{SHM_DIR} does not exist: the kvpool arena needs POSIX shared memory (Linux)")
        # every dead node's segment, not only this node's: a memory node killed for good (or
        # renamed) would otherwise keep its arena in /dev/shm until a node of its name starts
        sweep_stale(SEGMENT_PREFIX)
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise ConfigError(
                f"cannot allocate the kvpool arena: {capacity} blocks x {slot_bytes} B = {size / 2**30:.2f} GiB, "
                f"but {SHM_DIR} has {free / 2**30:.2f} GiB free; lower capacity_blocks or enlarge {SHM_DIR} "
                "(e.g. docker --shm-size)"
            )
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"shared memory segment {path} already exists "
                              "(another node with this boot id?)") from None
        try:
            os.ftruncate(fd, size)
            # commit the pages now: tmpfs is lazy, and running out later would SIGBUS a copy
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ConfigError(
                f"cannot allocate the kvpool arena ({size / 2**30:.2f} GiB in {SHM_DIR}): {exc}; "
                "lower capacity_blocks or enlarge /dev/shm"
            ) from None
        _HEADER.pack_into(mm, 0, ARENA_MAGIC, ARENA_VERSION, os.getpid(), boot_id.encode()[:32].ljust(32, b"0"),
                          slot_bytes, capacity)
        return cls(name, fd, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> Arena:
        """Map an existing segment read-write (one-sided access); TransferError if it is gone."""
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except OSError as exc:
            raise TransferError(f"cannot open shared memory segment {name}: {exc.strerror} "
                                "(memory node stopped?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < ARENA_HEADER_BYTES:
                raise TransferError(f"shared memory segment {name} is truncated ({size} bytes)")
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mm, owner=False)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment (readers that mapped it keep their copy)."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
        self._anchor = None
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            # a slot view is still referenced somewhere; the mapping goes with the last reference
            log.debug("arena %s: unmapping deferred, views still exported", self.name)

    # --- slots ---------------------------------------------------------------------------

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.capacity:
            raise TransferError(f"slot {slot} out of range: arena {self.name} has {self.capacity} slots")
        return ARENA_HEADER_BYTES + slot * self.slot_bytes

    def slot(self, index: int, length: int | None = None) -> memoryview:
        """A view of slot ``index`` (its first ``length`` bytes)."""
        n = self.slot_bytes if length is None else length
        if not 0 <= n <= self.slot_bytes:
            raise TransferError(f"{n} bytes do not fit a {self.slot_bytes}-byte slot")
        start = self.offset(index)
        return self.view[start : start + n]

    @property
    def address(self) -> int:
        """Virtual address of the mapping (for engines that register memory, e.g. Mooncake)."""
        if self._anchor is None:
            self._anchor = ctypes.c_char.from_buffer(self._mm)
        return ctypes.addressof(self._anchor)

    @property
    def nbytes(self) -> int:
        return len(self._mm)

    def owner_alive(self) -> bool:
        return pid_alive(self.pid)


def sweep_stale(prefix: str) -> list[str]:
    """Unlink segments named ``prefix*`` whose owner process is dead (left by a crash)."""
    removed: list[str] = []
    for path in SHM_DIR.glob(prefix + "*"):
        with contextlib.suppress(OSError), open(path, "rb") as fh:
            raw = fh.read(_HEADER.size)
            if len(raw) < _HEADER.size:
                continue
            magic, _, pid, *_ = _HEADER.unpack(raw)
            if magic == ARENA_MAGIC and not pid_alive(pid):
                path.unlink(missing_ok=True)
                removed.append(path.name)
                log.info("removed stale arena %s of dead process %d", path.name, pid)
    return removed
