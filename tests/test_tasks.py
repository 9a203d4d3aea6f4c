"""core.tasks.cancel_and_wait ends a task even when one cancel is lost, as Python 3.11's wait_for loses it."""

from __future__ import annotations

import asyncio

from core.tasks import cancel_and_wait


async def test_a_loop_that_swallows_a_cancel_still_ends():
    swallowed = 0
    started = asyncio.Event()

    async def stubborn():
        nonlocal swallowed
        started.set()
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:  # the second cancel ends it
                    raise
                swallowed += 1  # the first is lost, as wait_for loses one racing its result

    task = asyncio.create_task(stubborn())
    await started.wait()
    await asyncio.wait_for(cancel_and_wait(task, None), 5)
    assert task.cancelled() and swallowed == 1


async def test_the_outcome_of_a_task_that_failed_is_taken():
    async def fails():
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.done() and isinstance(task.exception(), RuntimeError)
