"""``cancel_and_wait`` ends a task even when the task swallows a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.tasks import cancel_and_wait


def test_a_task_that_swallows_one_cancel_still_ends() -> None:
    asyncio.run(_test_a_task_that_swallows_one_cancel_still_ends())


async def _test_a_task_that_swallows_one_cancel_still_ends() -> None:
    swallowed = 0
    started = asyncio.Event()

    async def stubborn() -> None:
        nonlocal swallowed
        started.set()
        while True:
            try:
                await asyncio.Event().wait()  # a read that never completes
            except asyncio.CancelledError:
                if swallowed:  # the second cancel is honoured
                    raise
                swallowed += 1  # as redis-py's pub/sub read can

    task = asyncio.create_task(stubborn())
    await started.wait()
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.01), timeout=30)
    assert task.cancelled()
    assert swallowed == 1


def test_the_tasks_own_error_is_raised() -> None:
    asyncio.run(_test_the_tasks_own_error_is_raised())


async def _test_the_tasks_own_error_is_raised() -> None:
    async def failing() -> None:
        raise ValueError("boom")

    task = asyncio.create_task(failing())
    await asyncio.wait({task})
    with pytest.raises(ValueError, match="boom"):
        await cancel_and_wait(task)


def test_a_finished_task_is_left_as_it_is() -> None:
    asyncio.run(_test_a_finished_task_is_left_as_it_is())


async def _test_a_finished_task_is_left_as_it_is() -> None:
    task = asyncio.create_task(asyncio.sleep(0))
    await task
    await cancel_and_wait(task)
    assert not task.cancelled()
