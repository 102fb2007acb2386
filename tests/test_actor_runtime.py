"""The runtime underneath the stages: doorway, observers, channels. No pipeline, no processes."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from omniloop.actors.doorway import Doorway, current_doorway
from omniloop.errors import FrameError, ObserverClosed
from omniloop.gpu.observer import CpuObserver, CudaObserver
from omniloop.transport.channel import Inbox, Outbox, context_users
from omniloop.transport.messages import Chunk


async def test_completion_from_another_thread_wakes_the_loop_without_any_timer():
    loop = asyncio.get_running_loop()
    doorway = Doorway(loop)
    future = loop.create_future()
    seen: dict[str, float | int] = {}

    def worker() -> None:
        time.sleep(0.05)  # the loop is asleep in select() by now
        seen["num_timers"] = len(loop._scheduled)
        seen["posted"] = time.perf_counter()
        doorway.resolve(future, 42)

    thread = threading.Thread(target=worker)
    thread.start()
    assert await future == 42
    handled = time.perf_counter()
    thread.join()
    assert seen["num_timers"] == 0, "the loop must sleep with no timer armed (no polling)"
    assert handled - seen["posted"] < 0.02, f"completion took {1000 * (handled - seen['posted']):.1f} ms to land"


async def test_many_posts_coalesce_into_one_wakeup_in_order():
    doorway = current_doorway()
    got: list[int] = []
    # Block the loop thread while another thread posts: all 200 posts must ride one drain callback.
    thread = threading.Thread(target=lambda: [doorway.post(got.append, i) for i in range(200)])
    thread.start()
    thread.join()
    before = doorway.num_wakeups
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert got == list(range(200))
    assert doorway.num_wakeups == before + 1


async def test_exceptions_cross_as_values_and_cancelled_futures_are_skipped():
    loop = asyncio.get_running_loop()
    doorway = Doorway(loop)
    failing, cancelled = loop.create_future(), loop.create_future()
    cancelled.cancel()
    threading.Thread(target=lambda: (doorway.resolve(failing, ValueError("bad step")), doorway.resolve(cancelled, 1))).start()
    with pytest.raises(ValueError, match="bad step"):
        await failing
    assert cancelled.cancelled()


def test_posts_to_a_closed_loop_are_dropped():
    loop = asyncio.new_event_loop()
    doorway = Doorway(loop)
    loop.close()
    doorway.post(print, "never")  # must not raise
    doorway.resolve(loop.create_future(), 1)


async def test_cpu_observer_runs_fifo_and_a_failing_step_fails_only_its_future():
    observer = CpuObserver(current_doorway(), name="test-cpu")
    order: list[int] = []

    def step(i: int):
        def run() -> int:
            order.append(i)
            if i == 1:
                raise RuntimeError("step 1 exploded")
            return i * 10

        return run

    futures = [observer.submit(step(i)) for i in range(3)]
    results = await asyncio.gather(*futures, return_exceptions=True)
    observer.close()
    assert order == [0, 1, 2]
    assert results[0] == 0 and results[2] == 20
    assert isinstance(results[1], RuntimeError) and "step 1 exploded" in str(results[1])


async def test_observer_close_joins_its_thread_and_fails_pending_steps():
    observer = CpuObserver(current_doorway(), name="test-close")
    release = threading.Event()
    first = observer.submit(lambda: release.wait(5))
    second = observer.submit(lambda: "never runs")
    threading.Timer(0.05, release.set).start()
    observer.close()
    assert not observer._thread.is_alive()
    for future in (first, second):
        with pytest.raises(ObserverClosed):
            await future
    with pytest.raises(ObserverClosed, match="closed"):
        observer.submit(lambda: 1)


async def test_cuda_observer_waits_on_each_event_in_order_then_finalizes():
    class Event:
        def __init__(self, delay: float) -> None:
            self.delay = delay

        def synchronize(self) -> None:
            time.sleep(self.delay)

    observer = CudaObserver(current_doorway(), name="test-stream")
    finalized: list[int] = []
    futures = [observer.submit(Event(d), lambda i=i: finalized.append(i) or i) for i, d in enumerate((0.03, 0.0, 0.01))]
    assert await asyncio.gather(*futures) == [0, 1, 2]
    assert finalized == [0, 1, 2]
    observer.close()


async def test_inbox_delivers_in_order_and_reports_garbage_without_dying():
    loop = asyncio.get_running_loop()
    users = context_users()
    inbox = Inbox("inproc://test-inbox")
    outbox = Outbox("inproc://test-inbox")
    outbox.attach(loop)
    received: list = []
    done = asyncio.Event()

    def on_batch(batch: list) -> None:
        received.extend(batch)
        if len(received) >= 602:
            done.set()

    inbox.attach(loop, on_batch)
    for i in range(300):
        outbox.send(Chunk("r", i), {"pcm": np.full(4, i, np.float32)})
    outbox._sock.send_multipart([b"\x02", b"\xc1junk"])
    outbox._sock.send_multipart([b"garbage"])
    for i in range(300, 600):
        outbox.send(Chunk("r", i))
    await asyncio.wait_for(done.wait(), 5)
    errors = [r for r in received if isinstance(r, FrameError)]
    messages = [r for r in received if not isinstance(r, FrameError)]
    assert len(errors) == 2
    assert [m.seq for m, _ in messages] == list(range(600))
    assert messages[7][1]["pcm"].tolist() == [7.0] * 4
    inbox.close()
    outbox.close()
    assert context_users() == users


def test_outbox_refuses_sends_from_a_thread_that_does_not_own_it():
    loop = asyncio.new_event_loop()
    try:
        outbox = Outbox("inproc://nobody")
        outbox.attach(loop)
        errors: list[Exception] = []

        def send() -> None:
            try:
                outbox.send(Chunk("r", 0))
            except RuntimeError as exc:
                errors.append(exc)

        thread = threading.Thread(target=send)
        thread.start()
        thread.join()
        assert errors and "does not own" in str(errors[0])
        outbox.close()
    finally:
        loop.close()


async def test_a_full_peer_queue_backs_up_in_order_instead_of_blocking_the_loop():
    loop = asyncio.get_running_loop()
    inbox = Inbox("inproc://test-backlog", hwm=1)
    outbox = Outbox("inproc://test-backlog", hwm=1)
    outbox.attach(loop)
    for i in range(50):
        outbox.send(Chunk("r", i))  # returns at once even though nobody is reading
    assert outbox.num_backlog > 0
    received: list[int] = []
    done = asyncio.Event()

    def on_batch(batch: list) -> None:
        received.extend(msg.seq for msg, _ in batch)
        if len(received) == 50:
            done.set()

    drained = []
    assert outbox.is_congested
    outbox.on_drain = lambda: drained.append(outbox.num_backlog)
    inbox.attach(loop, on_batch)
    await asyncio.wait_for(done.wait(), 5)
    assert received == list(range(50))
    assert outbox.num_backlog == 0 and not outbox.is_congested
    assert drained and drained[0] == 0  # told once the backlog emptied, on the loop
    inbox.close()
    outbox.close()
