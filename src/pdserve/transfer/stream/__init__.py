"""``store`` and ``direct``: the layer stream, into the KV store or pushed into the decode
worker (gRPC).

* ``header.py``: the stream's head (``StreamHeader``) and the checks of a hooked layer;
* ``frames.py``: the layer frame format, coded once: ``LayerCopy`` (sending, without copies
  of its own) and ``FrameCollector`` (assembly from pieces of any size);
* ``sender.py``: ``StreamSender``, the ``KVSender`` (a ``KVStore.Put`` or ``Decode.Push``
  stream; ``StreamTarget``, what it streams into);
* ``push.py``: ``PushClient``, the ``direct`` target (``Decode.Push``, ``Decode.Drop``);
* ``inbox.py``: ``Inbox``, the decode worker's pushed hand-offs, assembled as they land;
* ``receiver.py``: ``StreamReceiver`` (from the KV store) and ``LocalReceiver`` (from this
  decode worker's inbox), the ``KVReceiver``s.
"""
