"""Filling in the page tables of a mapping's ranges ahead of reading them (``Populator``)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

_MADV_POPULATE_READ = 22
"""Linux >= 5.14; not in Python 3.11's ``mmap`` module."""

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


class Populator:
    """Fills in the page tables of ranges of a private mapping, read-only, a call per range.

    Else each 4 KiB page is a minor fault when first hashed. ``MAP_POPULATE`` would not do:
    on a writable private mapping it write-faults, copying every page. ``madvise`` goes
    through ctypes, which lets go of the GIL (``mmap.madvise`` does not): the two threads
    that hash a segment's K and V each fault their own range in just before hashing it, at
    once (1K tokens of the base preset, 50 MB: 6-7 ms read whole and then hashed, 4-4.6 ms
    so). On a kernel without ``MADV_POPULATE_READ`` (EINVAL) the pages fault in as they are
    read, as they always did.
    """

    def __init__(self, mm: mmap.mmap) -> None:
        anchor = ctypes.c_char.from_buffer(mm)  # the mapping's address; no export kept
        self._base = ctypes.addressof(anchor)
        del anchor
        self._size = len(mm)
        self._supported = True

    def __call__(self, start: int, length: int) -> None:
        """Populate ``[start, start + length)``."""
        end = min(self._size, start + length)
        low = start - start % mmap.PAGESIZE
        if not self._supported or end <= low:
            return
        if _madvise(self._base + low, end - low, _MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                raise OSError(err, os.strerror(err))
            self._supported = False
