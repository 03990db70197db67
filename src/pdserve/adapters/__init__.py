"""The library's half of the service boundary: domain results to ``pdserve.v1`` answers.

It sits above the domain packages (worker roles, router, scheduling) and below ``services/``,
so nothing below it builds the answers of a service it does not serve.

``worker``: the Prefill, Decode and Mixed services' answers (``PrefillResult``,
``DecodeDelta``). ``router``: the Router service's answers (``RouteChunk``); the SDK's side of
the same messages is ``client.convert``. ``scheduler``: the Scheduler service's requests and
answers. ``prefill_servicer.PrefillServicer``: the servicer more than one process serves, so
that no service imports another: prefill workers (``services.prefill``) and mixed workers given
a KV store (``services.decode --role mixed``). It is as thin as one under ``services/``: it
translates messages to library calls and back, nothing more; a servicer served by one process
stays with it.
"""
