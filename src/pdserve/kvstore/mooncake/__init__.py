"""Mooncake Store as the KV store (``--kvstore mooncake://MASTER``): ``MooncakeStoreClient``
behind the same seam as ``KVStoreClient`` (``kvstore.backend``), and ``MasterProcess``, a
``mooncake_master`` child. The Mooncake package is optional (``pdserve[mooncake]``) and loaded
only when a ``mooncake://`` address is used. The package re-exports nothing, so that reading an
address loads no client: import from the modules themselves."""
