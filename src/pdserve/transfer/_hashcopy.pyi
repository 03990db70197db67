import numpy as np

def hash_copy(
    dst: bytearray | memoryview | np.ndarray,
    src: bytes | bytearray | memoryview | np.ndarray,
    piece_bytes: int,
    /,
) -> int:
    """Copy ``src`` into ``dst`` (same length, C-contiguous) with streaming stores and return
    the XXH3-64 of the bytes; releases the GIL."""

def hash64(data: bytes | bytearray | memoryview | np.ndarray, /) -> int:
    """The XXH3-64 of ``data`` (C-contiguous); releases the GIL on buffers of 64 KiB or more."""
