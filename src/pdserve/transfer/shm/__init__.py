"""``shm``: the same-host hand-off through a POSIX shared-memory segment.

* ``handoff.py``: ``ShmSender``/``ShmReceiver``, the transfer interface (``transfer.base``);
* ``writer.py``/``reader.py``: ``SegmentWriter``/``SegmentReader``, one segment written from
  the layer hook and read (checked, then unlinked or released) by the decode worker;
* ``follow.py``: reading a segment while its writer still fills it (a prefetch);
* ``segment.py``: the segment format; ``slots.py``: reused segments kept mapped;
  ``checksum.py``: the one-pass copy-and-hash; ``populate.py``: faulting mappings in ahead.

Import the submodules you need (this package imports nothing, so ``segment`` and ``slots``
stay importable without the rest).
"""
