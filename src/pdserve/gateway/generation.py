"""One HTTP request as several router requests: each prompt of a batch times ``n`` choices.

Each choice is its own ``Generate`` call through the SDK's ``AsyncClient`` (routing, retries
and cancellation are the SDK's and the router's), carrying the HTTP caller's API key
(``api_key``: the router takes the tenant from it); this module only fans them out and
merges the answers back, by choice index (``prompt_index * n + j``, as OpenAI numbers them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from pdserve.client import AsyncClient, Completion, Delta, RequestOptions

_SEED_MOD = 2**64


@dataclass(frozen=True, slots=True)
class Job:
    """One choice to generate."""

    index: int
    prompt: str | list[int]
    options: RequestOptions


def plan_jobs(
    prompts: Sequence[str | list[int]], n: int, options: RequestOptions, request_id: str
) -> list[Job]:
    """The jobs of a request, in choice order.

    With a seed, choice ``j`` of a prompt uses ``seed + j``: the choices differ from each other
    and the whole answer is still reproducible. Each job's request id is ``{request_id}-{index}``.
    """
    jobs = []
    seed = options.get("seed")
    for i, prompt in enumerate(prompts):
        for j in range(n):
            index = i * n + j
            job_options = RequestOptions(**options, request_id=f"{request_id}-{index}")
            if seed is not None and j and 0 <= seed < _SEED_MOD:
                job_options["seed"] = (seed + j) % _SEED_MOD
            jobs.append(Job(index, prompt, job_options))
    return jobs


async def generate_all(
    client: AsyncClient, jobs: Sequence[Job], timeout: float | None, api_key: str | None = None
) -> list[Completion]:
    """Every job's completion, in job order; the first failure cancels the others."""
    tasks = [
        asyncio.create_task(
            client.generate(job.prompt, timeout=timeout, api_key=api_key, **job.options)
        )
        for job in jobs
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # failures: already raised above


class _Done:
    """Queue marker: one job's stream ended."""


async def _pump(
    client: AsyncClient,
    job: Job,
    timeout: float | None,
    api_key: str | None,
    queue: asyncio.Queue[tuple[int, Delta] | _Done | Exception],
) -> None:
    try:
        async with client.stream(
            job.prompt, timeout=timeout, api_key=api_key, **job.options
        ) as stream:
            async for delta in stream:
                queue.put_nowait((job.index, delta))
    except Exception as err:  # handed to the consumer, which raises it
        queue.put_nowait(err)
        return
    queue.put_nowait(_Done())


async def stream_all(
    client: AsyncClient, jobs: Sequence[Job], timeout: float | None, api_key: str | None = None
) -> AsyncGenerator[tuple[int, Delta], None]:
    """``(choice index, delta)`` of every job as they arrive.

    Closing the generator (the HTTP client went away) cancels every call, which makes the
    router free what each request holds; the first failure does the same and is raised.
    """
    if len(jobs) == 1:
        job = jobs[0]
        async with client.stream(
            job.prompt, timeout=timeout, api_key=api_key, **job.options
        ) as stream:
            async for delta in stream:
                yield job.index, delta
        return
    queue: asyncio.Queue[tuple[int, Delta] | _Done | Exception] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(client, job, timeout, api_key, queue)) for job in jobs]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, _Done):
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # errors went through the queue
