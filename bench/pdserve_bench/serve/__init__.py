"""``pdserve bench serve``: serving under open-loop load, pdserve beside any OpenAI-compatible
server, in one run.

Requests arrive on a seeded schedule (Poisson at the offered rate, bursts, or a replayed
trace) and are sent at their time whatever is in flight (open loop, never closed loop): a
server that falls behind shows it as queueing in TTFT, not as a lower offered load. Each
request is a greedy (temperature 0) completion of a token-id prompt with ``ignore_eos`` and
``max_tokens`` = its output length, so every target does the same work on the same token ids.

Modules: ``mixes`` (named workloads), ``workload`` (the plan of a point), ``targets`` and
``openai`` (what is measured), ``runner`` (one point, open loop), ``records`` and ``metrics``
(what was seen, and its statistics), ``sweep`` (rates, targets interleaved, the rate search),
``report`` and ``plots`` (table, JSON, PNG, HTML), ``progress``, ``settings`` and ``cli``
(the command line).
"""
