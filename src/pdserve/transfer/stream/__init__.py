"""``store`` and ``direct``: the layer stream into a KVStore endpoint (gRPC).

* ``header.py``: the stream's head (``StreamHeader``) and the checks of a hooked layer;
* ``frames.py``: the layer frame format, coded once: ``LayerCopy`` (sending, without copies
  of its own) and ``FrameCollector`` (assembly from pieces of any size);
* ``sender.py``: ``StreamSender``, the ``KVSender`` (a ``KVStore.Put`` stream);
* ``receiver.py``: ``StreamReceiver`` (a remote endpoint) and ``LocalReceiver`` (this decode
  worker's own endpoint), the ``KVReceiver``s.
"""
