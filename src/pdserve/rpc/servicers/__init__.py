"""gRPC servicers that more than one process serves, so that no service imports another.

``prefill.PrefillServicer``: served by prefill workers (``services.prefill``) and by mixed
workers given a KV store (``services.decode --role mixed``). A servicer here is as thin as one
under ``services/``: it translates ``pdserve.v1`` messages to library calls and back
(``rpc.convert``), nothing more; a servicer served by one process stays with it.
"""
