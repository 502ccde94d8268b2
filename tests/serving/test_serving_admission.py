"""The admission gate: service slots, the waiting room (FIFO, then LIFO), refusal at the target."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, cast

from burstcv_serving.admission import RETRY_AFTER_S, AdmissionGate, Refusal
from burstcv_serving.batcher import MicroBatcher
from burstcv_serving.metrics import ServiceMetrics

TARGET_S = 0.1


class _Batcher:
    """What the gate reads of the batcher: how long a request admitted now would queue."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    def expected_delay_s(self) -> float:
        return self.delay_s


@dataclass(eq=False)
class _Request:
    """A waiting request that records what the gate did with it."""

    name: str
    arrived: float
    gone: bool = False
    admitted_at: float | None = None
    refused: Refusal | None = None
    log: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return not self.gone

    def admit(self, admitted_at: float) -> None:
        self.admitted_at = admitted_at
        self.log.append(self.name)

    def refuse(self, refused: Refusal) -> None:
        self.refused = refused


def _gate(slots: int, max_waiting: int = 100) -> tuple[AdmissionGate, _Batcher, ServiceMetrics]:
    batcher = _Batcher()
    metrics = ServiceMetrics()
    gate = AdmissionGate(
        cast(MicroBatcher, batcher),
        metrics,
        queue_delay_target_s=TARGET_S,
        max_waiting=max_waiting,
        min_slots=slots,
        max_slots=slots,
    )
    return gate, batcher, metrics


def _sample(metrics: ServiceMetrics, name: str, **labels: Any) -> float:
    return float(metrics.registry.get_sample_value(name, labels) or 0.0)


def test_requests_wait_for_a_free_slot_and_take_it_in_arrival_order() -> None:
    async def scenario() -> None:
        gate, _, metrics = _gate(slots=2)
        gate.start()
        order: list[str] = []
        now = time.perf_counter()
        requests = [_Request(f"r{i}", now, log=order) for i in range(4)]
        for request in requests:
            gate.offer(request)
        assert order == ["r0", "r1"] and gate.in_service == 2 and gate.waiting == 2
        assert _sample(metrics, "burstcv_serving_waiting_requests") == 2
        gate.release(cast(float, requests[0].admitted_at))
        assert order == ["r0", "r1", "r2"]  # a young queue is served oldest first
        gate.release(cast(float, requests[1].admitted_at))
        assert order == ["r0", "r1", "r2", "r3"] and gate.waiting == 0
        assert _sample(metrics, "burstcv_serving_admitted_requests_total") == 4

    asyncio.run(scenario())


def test_past_a_standing_queue_the_newest_request_is_served_first() -> None:
    async def scenario() -> None:
        gate, _, _ = _gate(slots=1)
        gate.start()
        order: list[str] = []
        now = time.perf_counter()
        holder = _Request("holder", now, log=order)
        gate.offer(holder)
        # The oldest has waited a third of the target: it could no longer be answered in
        # time after a long service, the newest still can.
        gate.offer(_Request("old", now - TARGET_S / 3, log=order))
        gate.offer(_Request("new", now, log=order))
        gate.release(cast(float, holder.admitted_at))
        assert order == ["holder", "new"]

    asyncio.run(scenario())


def test_a_request_that_waits_the_whole_target_is_refused_and_counted() -> None:
    async def scenario() -> tuple[_Request, _Request, ServiceMetrics]:
        gate, _, metrics = _gate(slots=1)
        gate.start()
        now = time.perf_counter()
        holder = _Request("holder", now)
        gate.offer(holder)
        late = _Request("late", now - TARGET_S + 0.005)  # reaches the target in 5 ms
        gate.offer(late)
        gone = _Request("gone", now - TARGET_S + 0.005, gone=True)  # its client hung up
        gate.offer(gone)
        deadline = time.monotonic() + 5
        while late.refused is None:
            assert time.monotonic() < deadline, "the waiting request was never refused"
            await asyncio.sleep(0.005)
        assert gate.waiting == 0
        return late, gone, metrics

    late, gone, metrics = asyncio.run(scenario())
    assert late.refused is not None and late.refused.reason == "queue_delay"
    assert "retry after 1 s" in late.refused.detail
    assert late.admitted_at is None
    assert gone.refused is None and gone.admitted_at is None
    shed = "burstcv_serving_shed_requests_total"
    assert _sample(metrics, shed, reason="queue_delay") == 1


def test_a_full_waiting_room_refuses_at_once() -> None:
    async def scenario() -> _Request:
        gate, _, metrics = _gate(slots=1, max_waiting=1)
        gate.start()
        now = time.perf_counter()
        for name in ("holder", "waits"):
            gate.offer(_Request(name, now))
        turned_away = _Request("turned away", now)
        gate.offer(turned_away)
        shed = "burstcv_serving_shed_requests_total"
        assert _sample(metrics, shed, reason="queue_full") == 1
        return turned_away

    turned_away = asyncio.run(scenario())
    assert turned_away.refused is not None and turned_away.refused.reason == "queue_full"


def test_a_slow_model_queue_keeps_requests_waiting_but_an_idle_service_admits() -> None:
    async def scenario() -> None:
        gate, batcher, _ = _gate(slots=8)
        gate.start()
        order: list[str] = []
        now = time.perf_counter()
        batcher.delay_s = 2 * TARGET_S  # the model's queue would hold a new request too long
        first = _Request("first", now, log=order)
        gate.offer(first)  # nothing in service: admitted whatever the queue says
        gate.offer(_Request("second", now, log=order))
        assert order == ["first"] and gate.waiting == 1
        batcher.delay_s = 0.0
        gate.release(cast(float, first.admitted_at))
        assert order == ["first", "second"]

    asyncio.run(scenario())


def test_the_slots_follow_the_answer_rate_of_saturated_windows() -> None:
    """Quick answers with every slot taken raise the slots (at most doubling per window);
    slow ones lower them (at most halving), to the rate times half the target."""

    async def scenario() -> None:
        batcher = _Batcher()
        metrics = ServiceMetrics()
        gate = AdmissionGate(
            cast(MicroBatcher, batcher),
            metrics,
            queue_delay_target_s=TARGET_S,
            max_waiting=100,
            min_slots=2,
            max_slots=64,
        )
        gate.start()
        assert gate.slots == 2  # the floor to start with
        seen = [gate.slots]
        until = time.perf_counter() + 20 * TARGET_S
        while gate.slots < 64 and time.perf_counter() < until:  # saturated, answered at once
            requests = [_Request("r", time.perf_counter()) for _ in range(gate.slots)]
            for request in requests:
                gate.offer(request)
            for request in requests:
                gate.release(cast(float, request.admitted_at))
            if gate.slots != seen[-1]:
                seen.append(gate.slots)
        assert seen[-1] == 64, seen
        assert all(b <= 2 * a for a, b in itertools.pairwise(seen)), seen
        assert _sample(metrics, "burstcv_serving_admission_slots") == 64

        requests = [_Request("r", time.perf_counter()) for _ in range(64)]
        for request in requests:
            gate.offer(request)
        # The moving average of the rate forgets the thousands per second above in a few
        # tenths of a second.
        for request in requests[:30]:  # one answer a window: far too slow for 64 slots
            gate.offer(_Request("waits", time.perf_counter()))
            await asyncio.sleep(TARGET_S / 2)
            before = gate.slots
            gate.release(cast(float, request.admitted_at))
            assert before / 2 <= gate.slots <= before
        assert gate.slots <= 8

    asyncio.run(scenario())


def test_an_early_retry_waits_until_its_retry_after_but_may_take_a_slot_while_fresh() -> None:
    async def scenario() -> tuple[_Request, _Request, ServiceMetrics]:
        gate, _, metrics = _gate(slots=1)
        gate.start()
        now = time.perf_counter()
        holder = _Request("holder", now)
        gate.offer(holder)
        # Came back at once after a 503 asking for 1 s, 0.1 s ago: past the target, but its
        # 503 is due only at Retry-After.
        stale = _Request("stale", now - TARGET_S, log=[])
        gate.offer(stale, early_retry=True)
        fresh = _Request("fresh", now, log=[])
        gate.offer(fresh, early_retry=True)
        gate.release(cast(float, holder.admitted_at))
        assert fresh.admitted_at is not None  # the newest takes the slot, early or not
        await asyncio.sleep(2 * TARGET_S)
        assert stale.refused is None  # a normal request would have had its 503 by now
        due = _Request("due", time.perf_counter() - RETRY_AFTER_S + 0.01)
        gate.offer(due, early_retry=True)
        deadline = time.monotonic() + 5
        while due.refused is None:
            assert time.monotonic() < deadline, "the early retry was never refused"
            await asyncio.sleep(0.005)
        return stale, due, metrics

    stale, due, metrics = asyncio.run(scenario())
    assert due.refused is not None and due.refused.reason == "early_retry"
    assert "Retry-After" in due.refused.detail
    assert stale.admitted_at is None
    shed = "burstcv_serving_shed_requests_total"
    assert _sample(metrics, shed, reason="early_retry") >= 1


def test_the_room_is_swept_again_after_a_sweep_admitted_everyone() -> None:
    """A sweep that finds free slots for every waiting request leaves no timer behind, so the
    next request to wait is refused at the target like the others."""

    async def scenario() -> _Request:
        gate, batcher, _ = _gate(slots=2)
        gate.start()
        now = time.perf_counter()
        gate.offer(_Request("holder", now))
        batcher.delay_s = 2 * TARGET_S  # no room in the model's queue: the next ones wait
        expiring = _Request("expiring", now - TARGET_S + 0.02)  # due for its 503 in 20 ms
        gate.offer(expiring)
        fits = _Request("fits", now)
        gate.offer(fits)
        batcher.delay_s = 0.0
        # The sweep refuses the first and, a slot being free, admits the second.
        await asyncio.sleep(0.1)
        assert expiring.refused is not None and fits.admitted_at is not None
        assert gate.waiting == 0
        gate.offer(_Request("holder 2", time.perf_counter()))  # every slot taken again
        late = _Request("late", time.perf_counter())
        gate.offer(late)
        deadline = time.monotonic() + 5
        while late.refused is None:
            assert time.monotonic() < deadline, "no sweep refused the next waiting request"
            await asyncio.sleep(0.005)
        return late

    assert asyncio.run(scenario()).refused is not None
