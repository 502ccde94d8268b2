"""The admission gate: service slots, the waiting room (FIFO, then LIFO), refusal at the target."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from burstcv_serving import admission
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
    refused_at: float | None = None  # time.perf_counter() when it was refused
    log: list[str] = field(default_factory=list)
    alive_checks: int = 0  # how often the gate looked at it

    def alive(self) -> bool:
        self.alive_checks += 1
        return not self.gone

    def admit(self, admitted_at: float) -> None:
        self.admitted_at = admitted_at
        self.log.append(self.name)

    def refuse(self, refused: Refusal) -> None:
        self.refused = refused
        self.refused_at = time.perf_counter()


def _gate(
    slots: int,
    max_waiting: int = 100,
    *,
    target_s: float = TARGET_S,
    max_slots: int | None = None,
) -> tuple[AdmissionGate, _Batcher, ServiceMetrics]:
    batcher = _Batcher()
    metrics = ServiceMetrics()
    gate = AdmissionGate(
        cast(MicroBatcher, batcher),
        metrics,
        queue_delay_target_s=target_s,
        max_waiting=max_waiting,
        min_slots=slots,
        max_slots=slots if max_slots is None else max_slots,
    )
    return gate, batcher, metrics


# A clock the test moves: exact limits and measured rates, and no time passing unless the test
# says so (a loaded machine does not turn a young queue into a standing one).
# A target of half a second makes its quarter (the service share, the LIFO threshold) exact in
# binary floating point, so "exactly at the limit" is exact.
EXACT_TARGET_S = 0.5


class _Clock:
    """The admission module's clock, moved by the test (time.perf_counter's stand-in)."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(admission, "time", fake)
    return fake


def _sample(metrics: ServiceMetrics, name: str, **labels: Any) -> float:
    return float(metrics.registry.get_sample_value(name, labels) or 0.0)


def test_requests_wait_for_a_free_slot_and_take_it_in_arrival_order(clock: _Clock) -> None:
    async def scenario() -> None:
        gate, _, metrics = _gate(slots=2)
        gate.start()
        order: list[str] = []
        now = clock.now
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


def test_past_a_standing_queue_the_newest_request_is_served_first(clock: _Clock) -> None:
    async def scenario() -> None:
        gate, _, _ = _gate(slots=1)
        gate.start()
        order: list[str] = []
        now = clock.now
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


def test_a_slow_model_queue_keeps_requests_waiting_but_an_idle_service_admits(
    clock: _Clock,
) -> None:
    async def scenario() -> None:
        gate, batcher, _ = _gate(slots=8)
        gate.start()
        order: list[str] = []
        now = clock.now
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


def _answer_saturated(
    gate: AdmissionGate, clock: _Clock, serving: deque[_Request], per_second: float, answers: int
) -> list[int]:
    """Keep every slot taken and give ``answers`` answers at ``per_second`` a second.

    Return the slot count after each answer.
    """
    slots = []
    for _ in range(answers):
        while gate.in_service < gate.slots:
            request = _Request("r", clock.now)
            gate.offer(request)
            assert request.admitted_at is not None, "a free slot was not taken"
            serving.append(request)
        clock.now += 1 / per_second
        gate.release(cast(float, serving.popleft().admitted_at))
        slots.append(gate.slots)
    return slots


def _changes(values: list[int]) -> list[int]:
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def test_the_slots_settle_on_the_saturated_answer_rate_times_a_quarter_of_the_target(
    clock: _Clock,
) -> None:
    gate, _, metrics = _gate(8, target_s=EXACT_TARGET_S, max_slots=64)
    serving: deque[_Request] = deque()
    # 84 answers a second, admitted requests taking a quarter of the target: 10.5 in service,
    # from the first window (a quarter of the target: 11 answers) on.
    assert _changes(_answer_saturated(gate, clock, serving, 84, 16 * 11)) == [8, 10]
    # One window (32 answers) at three times the rate: the average moves 30% of the way
    # (84 -> 134.4 a second), not all of it.
    assert _changes(_answer_saturated(gate, clock, serving, 252, 32)) == [10, 16]
    # Sustained, the slots follow (252 x 0.125 = 31.5), never more than doubling a window.
    seen = _changes([16, *_answer_saturated(gate, clock, serving, 252, 500)])
    assert seen[-1] == 31 and all(b <= 2 * a for a, b in itertools.pairwise(seen)), seen
    assert _sample(metrics, "burstcv_serving_admission_slots") == 31
    # Far faster: capped at the most the configuration allows.
    assert _answer_saturated(gate, clock, serving, 2000, 2000)[-1] == 64
    # A slow service: down to the floor, never below it.
    slow = _answer_saturated(gate, clock, serving, 20, 60)
    assert slow[-1] == 8 and min(slow) == 8


def test_a_window_that_opens_with_every_slot_taken_is_saturated_even_if_nothing_arrives(
    clock: _Clock,
) -> None:
    gate, _, _ = _gate(8, target_s=EXACT_TARGET_S, max_slots=64)
    serving: deque[_Request] = deque()
    assert _answer_saturated(gate, clock, serving, 84, 4 * 11)[-1] == 10
    # A slower window (60 answers a second) brings the slots down to the 9 still in service.
    assert _answer_saturated(gate, clock, serving, 60, 8)[-1] == 9
    assert gate.in_service == 9
    # No request arrives; those in service are answered, still 60 a second: every slot was
    # taken when the window opened, so its rate counts.
    for _ in range(8):
        clock.now += 1 / 60
        gate.release(cast(float, serving.popleft().admitted_at))
    assert gate.slots == 8


def test_a_window_closes_exactly_a_quarter_of_the_target_after_it_opened(clock: _Clock) -> None:
    gate, _, _ = _gate(8, target_s=EXACT_TARGET_S, max_slots=64)
    serving: deque[_Request] = deque()
    for _ in range(8):
        serving.append(_Request("r", clock.now))
        gate.offer(serving[-1])
    clock.now += EXACT_TARGET_S / 8  # half the window: its answers change nothing yet
    for _ in range(8):
        gate.release(cast(float, serving.popleft().admitted_at))
        serving.append(_Request("r", clock.now))
        gate.offer(serving[-1])
        assert gate.slots == 8
    clock.now += EXACT_TARGET_S / 8  # exactly a quarter of the target
    gate.release(cast(float, serving.popleft().admitted_at))
    assert gate.slots == 9  # 9 answers in 0.125 s: 72 a second, x 0.125 s


def test_a_service_that_never_takes_every_slot_keeps_its_slots(clock: _Clock) -> None:
    """Answers of an unsaturated service say nothing about what it could do."""
    gate, _, _ = _gate(2, target_s=EXACT_TARGET_S, max_slots=64)
    for _ in range(200):  # one request at a time, 400 answers a second
        request = _Request("r", clock.now)
        gate.offer(request)
        clock.now += 1 / 400
        gate.release(cast(float, request.admitted_at))
    assert gate.slots == 2 and gate.in_service == 0


def test_requests_waiting_for_a_long_model_queue_count_as_saturation(clock: _Clock) -> None:
    """Slots are free, but the model's queue is too long to admit: requests wait, so the
    answer rate measures what the service can do."""

    async def scenario() -> None:
        gate, batcher, _ = _gate(8, target_s=EXACT_TARGET_S, max_slots=64)
        gate.start()
        batcher.delay_s = 2 * EXACT_TARGET_S
        serving = _Request("first", clock.now)
        gate.offer(serving)  # an idle service admits whatever the queue says
        waiting = _Request("waits", clock.now)
        gate.offer(waiting)
        assert waiting.admitted_at is None and gate.waiting == 1
        for _ in range(168):  # 84 answers a second, one in service, one waiting
            clock.now += 1 / 84
            gate.release(cast(float, serving.admitted_at))
            assert waiting.admitted_at is not None  # the idle service takes the waiting one
            serving, waiting = waiting, _Request("waits", clock.now)
            gate.offer(waiting)
        assert gate.slots == 10  # 84 x 0.125 s

    asyncio.run(scenario())


def test_at_exactly_the_target_an_idle_service_admits_and_later_refuses(clock: _Clock) -> None:
    async def scenario() -> None:
        gate, _, metrics = _gate(1, target_s=EXACT_TARGET_S)
        gate.start()
        on_time = _Request("on time", clock.now - EXACT_TARGET_S)  # waited exactly the target
        gate.offer(on_time)
        assert on_time.admitted_at == clock.now
        gate.release(clock.now)
        late = _Request("late", clock.now - EXACT_TARGET_S - 0.001)
        gate.offer(late)
        await asyncio.sleep(0.05)  # the sweep answers it at once
        assert late.admitted_at is None
        assert late.refused is not None and late.refused.reason == "queue_delay"
        assert gate.waiting == 0 and gate.in_service == 0
        wait_sum = _sample(metrics, "burstcv_serving_admission_wait_seconds_sum")
        assert wait_sum == pytest.approx(EXACT_TARGET_S)  # what the admitted one waited

    asyncio.run(scenario())


def test_a_waiting_request_that_reaches_the_target_exactly_is_refused(clock: _Clock) -> None:
    async def scenario() -> None:
        gate, _, _ = _gate(1, target_s=EXACT_TARGET_S)
        gate.start()
        gate.offer(_Request("holder", clock.now))
        due = _Request("due", clock.now - EXACT_TARGET_S)
        gate.offer(due)  # every slot taken: it waits, and its time is up
        await asyncio.sleep(0.05)
        assert due.refused is not None and due.refused.reason == "queue_delay"
        assert gate.waiting == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("queue_delay_s", "admitted"), [(0.25, True), (0.375, False)], ids=["fits", "too long"]
)
def test_a_request_is_admitted_only_if_its_batch_starts_within_the_target(
    clock: _Clock, queue_delay_s: float, admitted: bool
) -> None:
    async def scenario() -> None:
        gate, batcher, _ = _gate(8, target_s=EXACT_TARGET_S)
        gate.start()
        gate.offer(_Request("busy", clock.now))
        batcher.delay_s = queue_delay_s
        # It waited a quarter of the target in the socket: 0.25 + 0.25 is exactly the target.
        request = _Request("r", clock.now - 0.25)
        gate.offer(request)
        assert (request.admitted_at is not None) is admitted
        assert gate.waiting == (0 if admitted else 1)

    asyncio.run(scenario())


def test_the_oldest_goes_first_until_it_has_waited_more_than_a_quarter_of_the_target(
    clock: _Clock,
) -> None:
    async def scenario() -> None:
        gate, _, _ = _gate(1, target_s=EXACT_TARGET_S)
        gate.start()
        order: list[str] = []
        holder = _Request("holder", clock.now, log=order)
        gate.offer(holder)
        gate.offer(_Request("old", clock.now - EXACT_TARGET_S / 4, log=order))  # exactly
        gate.offer(_Request("new", clock.now, log=order))
        gate.release(cast(float, holder.admitted_at))
        assert order == ["holder", "old"]

    asyncio.run(scenario())


def test_past_a_standing_queue_the_newest_of_all_goes_first_early_retry_or_not(
    clock: _Clock,
) -> None:
    async def scenario() -> ServiceMetrics:
        gate, _, metrics = _gate(1, target_s=EXACT_TARGET_S)
        gate.start()
        order: list[str] = []
        holder = _Request("holder", clock.now, log=order)
        gate.offer(holder)
        old = _Request("old", clock.now - 0.2, log=order)  # the queue stands
        gate.offer(old)
        gate.offer(_Request("early retry", clock.now - 0.01, log=order), early_retry=True)
        newest = _Request("newest", clock.now, log=order)
        gate.offer(newest)
        assert gate.waiting == 3
        gate.release(cast(float, holder.admitted_at))
        gate.release(cast(float, newest.admitted_at))
        gate.release(clock.now)
        assert order == ["holder", "newest", "early retry", "old"]
        return metrics

    metrics = asyncio.run(scenario())
    # What the admitted requests waited: 0 + 0 + 0.01 + 0.2 s.
    wait_sum = _sample(metrics, "burstcv_serving_admission_wait_seconds_sum")
    assert wait_sum == pytest.approx(0.21)


def _learn_then_wait(clock: _Clock, waited_s: float) -> _Request:
    """Two answers teach the gate how long an admitted request takes (0.2 s, then one of
    2.2 s); then a request that has waited ``waited_s`` is offered a freed slot."""

    async def scenario() -> _Request:
        gate, _, _ = _gate(2, target_s=EXACT_TARGET_S)
        gate.start()
        start = clock.now
        first, second = _Request("first", start), _Request("second", start)
        gate.offer(first)
        gate.offer(second)
        clock.now = start + 0.2
        gate.release(start)  # the first answer: 0.2 s
        gate.offer(_Request("third", clock.now))
        clock.now = start + 2.2
        waiter = _Request("waiter", clock.now - waited_s)
        gate.offer(waiter)
        assert waiter.admitted_at is None  # every slot taken
        gate.release(start)  # an answer of 2.2 s (a GC pause): the expectation moves 5%
        return waiter

    return asyncio.run(scenario())


@pytest.mark.parametrize(("waited_s", "admitted"), [(0.19, True), (0.21, False)])
def test_a_waiting_request_is_admitted_only_if_it_can_still_be_answered_in_time(
    clock: _Clock, waited_s: float, admitted: bool
) -> None:
    # An admitted request is expected to take 0.2 + 5% of 2.0 = 0.3 s: one that has waited
    # more than 0.2 s of the 0.5 s target could not be answered in time.
    waiter = _learn_then_wait(clock, waited_s)
    assert (waiter.admitted_at is not None) is admitted


def test_a_fresh_request_takes_a_free_slot_even_when_answers_have_been_slow(clock: _Clock) -> None:
    """Only a request that already waited in the room needs the service time to fit: a new
    one whose batch starts in time is served."""

    async def scenario() -> None:
        gate, _, _ = _gate(2, target_s=EXACT_TARGET_S)
        gate.start()
        start = clock.now
        gate.offer(_Request("a", start))
        gate.offer(_Request("b", start))
        clock.now = start + 0.6  # answers take longer than the whole target
        gate.release(start)
        fresh = _Request("fresh", clock.now)
        gate.offer(fresh)
        assert fresh.admitted_at == clock.now

    asyncio.run(scenario())


def test_a_slow_upload_does_not_count_as_service_time(clock: _Clock) -> None:
    async def scenario() -> None:
        gate, _, _ = _gate(2, target_s=EXACT_TARGET_S)
        gate.start()
        start = clock.now
        gate.offer(_Request("uploads slowly", start))
        gate.offer(_Request("other", start))
        clock.now = start + 1.2
        waiter = _Request("waiter", clock.now - 0.25)
        gate.offer(waiter)
        # Admitted at start, its body read a second later, answered 0.2 s after that.
        gate.release(start, body_read_at=start + 1.0)
        assert waiter.admitted_at is not None  # 0.25 s waited + 0.2 s expected fits in 0.5

    asyncio.run(scenario())


# --- Real time: refusals at their deadlines, and no busy sweeping ------------------------------
def test_each_waiting_request_is_refused_at_its_own_target_not_before() -> None:
    target_s = 0.4

    async def scenario() -> tuple[_Request, _Request]:
        # No start(): the gate sweeps on the loop the requests are offered on.
        gate, _, _ = _gate(1, target_s=target_s)
        now = time.perf_counter()
        gate.offer(_Request("holder", now))
        first = _Request("first", now - target_s + 0.01)  # due in 10 ms
        second = _Request("second", now)  # due in 400 ms
        gate.offer(first)
        gate.offer(second)
        deadline = time.monotonic() + 5
        while first.refused is None or second.refused is None:
            assert time.monotonic() < deadline, "a waiting request was never refused"
            await asyncio.sleep(0.005)
        assert gate.waiting == 0
        return first, second

    first, second = asyncio.run(scenario())
    for request in (first, second):
        assert request.refused is not None and request.refused.reason == "queue_delay"
        assert cast(float, request.refused_at) >= request.arrived + target_s
    assert cast(float, first.refused_at) < second.arrived + target_s  # not at the second's


def test_a_request_behind_an_early_retry_is_refused_at_its_target_not_at_retry_after() -> None:
    async def scenario() -> _Request:
        gate, _, _ = _gate(1)
        gate.start()
        now = time.perf_counter()
        gate.offer(_Request("holder", now))
        gate.offer(_Request("early retry", now), early_retry=True)  # the sweep: in 1 s
        waits = _Request("waits", now)
        gate.offer(waits)  # due at the 100 ms target
        deadline = time.monotonic() + 5
        while waits.refused is None:
            assert time.monotonic() < deadline, "the waiting request was never refused"
            await asyncio.sleep(0.005)
        return waits

    waits = asyncio.run(scenario())
    assert waits.refused is not None and waits.refused.reason == "queue_delay"
    assert cast(float, waits.refused_at) < waits.arrived + RETRY_AFTER_S / 2


@pytest.mark.parametrize("early_retry_first", [True, False], ids=["retry first", "retry last"])
def test_waiting_requests_cost_the_event_loop_nothing_until_one_is_due(
    early_retry_first: bool,
) -> None:
    async def scenario() -> list[_Request]:
        gate, _, _ = _gate(1, target_s=1.0)  # both are due in a second
        gate.start()
        now = time.perf_counter()
        gate.offer(_Request("holder", now))
        early, normal = _Request("early retry", now), _Request("waits", now)
        for request in (early, normal) if early_retry_first else (normal, early):
            gate.offer(request, early_retry=request is early)
        await asyncio.sleep(0.1)
        return [early, normal]

    for request in asyncio.run(scenario()):
        assert request.alive_checks == 0 and request.refused is None


def test_early_retries_count_in_the_waiting_rooms_limit() -> None:
    async def scenario() -> tuple[AdmissionGate, _Request]:
        gate, _, _ = _gate(1, max_waiting=2)
        gate.start()
        now = time.perf_counter()
        gate.offer(_Request("holder", now))
        gate.offer(_Request("waits", now))
        gate.offer(_Request("early retry", now), early_retry=True)
        turned_away = _Request("turned away", now)
        gate.offer(turned_away)
        return gate, turned_away

    gate, turned_away = asyncio.run(scenario())
    assert gate.waiting == 2
    assert turned_away.refused is not None and turned_away.refused.reason == "queue_full"


def test_the_503_says_the_target_in_milliseconds_as_json() -> None:
    async def scenario() -> tuple[AdmissionGate, _Request]:
        gate, _, _ = _gate(1, target_s=2.0)
        gate.start()
        late = _Request("late", time.perf_counter() - 2.5)  # waited in the socket past 2 s
        gate.offer(late)
        deadline = time.monotonic() + 5
        while late.refused is None:
            assert time.monotonic() < deadline, "the late request was never refused"
            await asyncio.sleep(0.005)
        return gate, late

    gate, late = asyncio.run(scenario())
    assert gate.queue_delay_target_s == 2.0
    refused = cast(Refusal, late.refused)
    assert "queueing-delay target of 2000 ms; retry after 1 s" in refused.detail
    assert json.loads(refused.body()) == {"detail": refused.detail}
