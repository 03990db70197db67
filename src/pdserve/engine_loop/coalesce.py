"""Coalescing of a request's engine outputs that are already waiting for its consumer.

A streaming consumer that keeps up gets every output as soon as it exists; one that fell
behind (its event loop was busy) finds several outputs queued and takes them as one, so that
it forwards one message instead of several: catching up costs one hop, not one per token.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdserve.engine.outputs import RequestOutput


def merge_ready(
    item: RequestOutput | BaseException,
    ready: asyncio.Queue[RequestOutput | BaseException],
) -> RequestOutput | BaseException:
    """``item`` with the outputs already waiting behind it merged in (see ``coalesce``).

    An error, or an output carrying logits (one step's, not mergeable), is never merged.
    """
    if isinstance(item, BaseException) or item.logits is not None:
        return item
    merged: RequestOutput | None = None
    while not item.finished and not ready.empty():
        nxt = ready.get_nowait()
        if isinstance(nxt, BaseException) or nxt.logits is not None:
            # Stays next in line: the consumer gets it right after this output.
            push_front(ready, nxt)
            break
        if merged is None:  # copy: the engine's own object is left as it was
            merged = dataclasses.replace(
                item,
                new_token_ids=list(item.new_token_ids),
                new_logprobs=list(item.new_logprobs),
                new_top_logprobs=list(item.new_top_logprobs),
            )
        merged.new_token_ids += nxt.new_token_ids
        merged.new_logprobs += nxt.new_logprobs
        merged.new_top_logprobs += nxt.new_top_logprobs
        merged.prompt_logprobs = merged.prompt_logprobs or nxt.prompt_logprobs
        merged.text += nxt.text
        merged.finished, merged.finish_reason = nxt.finished, nxt.finish_reason
        merged.num_cached_tokens = nxt.num_cached_tokens
        item = merged
    return item


def push_front(
    ready: asyncio.Queue[RequestOutput | BaseException], item: RequestOutput | BaseException
) -> None:
    """Put ``item`` back at the head of ``ready`` (everything behind it keeps its order)."""
    rest = [ready.get_nowait() for _ in range(ready.qsize())]
    for x in (item, *rest):
        ready.put_nowait(x)
