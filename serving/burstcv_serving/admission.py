"""Admit prediction requests into service only as fast as they can be answered within the target.

Under overload the service's limit is its event loop (reading, parsing and decoding each
request, writing each answer), not only the model: admitting every request the model could
batch in time would let hundreds of them wait for the loop, every one answered late. So a
request needs one of a limited number of *service slots* to be served (its body read,
parsed, decoded, batched, answered). The number follows measurement: the answer rate of the
windows in which every slot was taken, times a quarter of the queueing-delay target
(Little's law: admitted requests then take about that long), never fewer than two full
batches (one running while the next one gathers) nor more than the inference queue holds.

A request that finds every slot taken waits for one in a *waiting room*, at the cost of a
small object: its body is not read, parsed or decoded. A freed slot goes to the oldest
waiting request while the room empties quickly, and to the newest once the oldest has
waited a quarter of the queueing-delay target: a standing queue has formed, the old ones
could no longer be answered in time and the new ones still can (CoDel's sojourn time
against a target, with adaptive LIFO). A free slot is taken while the model's queue would
let the request's batch start within the target; from the room, only while the time it has
waited plus the time an admitted request now takes (measured) still fits in the target. A
request that has waited the whole target is answered 503 with ``Retry-After``, its body
unread. So an admitted request is answered within its deadline.

A refusal costs the event loop far less than a prediction, but a client that ignores
Retry-After and sends again at once would come back once per target, and hundreds of them
would keep the loop busy refusing. So a request that arrives on a connection before the
Retry-After of the 503 answered on it has passed (an *early retry*) may still take a slot
while it is fresh, but otherwise gets its 503 only when that Retry-After has passed since
its arrival: a retry storm waits for its answers instead of taking the cores from the
requests being served. Clients that honour Retry-After never see the difference.

The decision is taken as soon as a request's headers are parsed: in the service's HTTP
protocol (``burstcv_serving.protocol``) before a task is started for the request, and in the
ASGI middleware under uvicorn's public protocol (the fallback ``protocol_for`` picks when the
installed uvicorn is not the one the service's protocol was written for, or the setting
``fast_protocol`` is off), any other server and the test client. Everything here runs on
the event loop: no lock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from burstcv_serving.batcher import MicroBatcher
from burstcv_serving.metrics import SHED_REASONS, ServiceMetrics

PREDICTION_PATHS = frozenset({"/v1/predict", "/v1/predict/batch"})

# Key in a request's scope state: seconds it waited for a service slot (its queueing delay
# so far, which the batcher's deadline counts).
ADMISSION_WAIT = "burstcv_admission_wait_s"

# Key in a request's scope state: time.perf_counter() when its body had been read. The time an
# admitted request takes is counted from then: a slow upload does not load the event loop.
BODY_READ_AT = "burstcv_body_read_at"

# Seconds a shed client is asked to wait. HTTP allows whole seconds only; the queue drains
# in milliseconds, so the smallest value is the right one.
RETRY_AFTER_S = 1

# Share of the queueing-delay target that admitted requests should take from admission to
# their answer, on average: the slot count follows the measured answer rate times this time
# (Little's law), so that a faster machine or model admits more at once, and a slower one
# fewer (down to the floor). The rest of the target is for the slow tail, the wait in the
# room, and the wait in the socket before the event loop reads the request.
SERVICE_SHARE = 0.25
# Once the oldest waiting request has waited this share of the target, slots go to the
# newest first (adaptive LIFO): a standing queue has formed.
LIFO_SHARE = 0.25
# Weight of the newest saturated window in the moving average of the answer rate: the last
# few windows (a few tenths of a second) count, so bursts of answers do not swing the slots.
_RATE_WEIGHT = 0.3
# Weight of the newest answer in the moving average of the time an admitted request takes.
_SERVICE_WEIGHT = 0.05


@dataclass(frozen=True)
class Refusal:
    """Say why a request is shed: the metric's reason label and the client's message."""

    reason: str  # one of metrics.SHED_REASONS
    detail: str

    def body(self) -> bytes:
        """Return the JSON body of the 503, as FastAPI writes an HTTPException's."""
        return json.dumps({"detail": self.detail}).encode()


class Waiter(Protocol):
    """A prediction request waiting for a slot, as the gate sees it."""

    arrived: float  # time.perf_counter() when its headers were parsed

    def alive(self) -> bool:
        """Tell whether its client still waits for an answer."""

    def admit(self, admitted_at: float) -> None:
        """Start serving it: its slot is taken; it calls AdmissionGate.release when answered,
        and puts ADMISSION_WAIT (and, once read, BODY_READ_AT) in its scope state."""

    def refuse(self, refused: Refusal) -> None:
        """Answer it 503 with Retry-After, without reading its body."""


class AdmissionGate:
    """Hand out service slots to prediction requests, park the rest, refuse at the target."""

    def __init__(
        self,
        batcher: MicroBatcher,
        metrics: ServiceMetrics,
        *,
        queue_delay_target_s: float,
        max_waiting: int,
        min_slots: int,
        max_slots: int,
    ) -> None:
        self._batcher = batcher
        self._metrics = metrics
        self._max_waiting = max_waiting
        self.set_target(queue_delay_target_s)
        self._early_expired = Refusal(
            "early_retry",
            "the service is overloaded: this request came before the Retry-After of the 503 "
            "answered on its connection had passed, and no service slot freed for it; retry "
            f"after {RETRY_AFTER_S} s",
        )
        self._room_full = Refusal(
            "queue_full",
            "the service is overloaded and its waiting room is full "
            f"({max_waiting} requests wait for a slot); retry after {RETRY_AFTER_S} s",
        )
        self._shed = {reason: metrics.shed.labels(reason=reason) for reason in SHED_REASONS}
        self._min_slots = max(1, min_slots)
        self._max_slots = max(self._min_slots, max_slots)
        self._slots = self._min_slots
        self._in_service = 0
        self._waiting: deque[Waiter] = deque()
        # Early retries (see offer): they wait up to Retry-After instead of the target.
        self._held: deque[Waiter] = deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_due = float("inf")  # time.perf_counter() the sweep is armed for
        self._loop: asyncio.AbstractEventLoop | None = None
        # The time an admitted request takes, from admission (or the end of its body) to its
        # answer: a moving average, what admission expects of the next one.
        self._service_s = 0.0
        # Answers in the current window, and whether every slot was taken or a request waited
        # in it (only then does the answer rate measure what the service can do).
        self._window_start = time.perf_counter()
        self._window_answers = 0
        self._window_full = False
        self._rate = 0.0  # moving average of the answer rate of saturated windows, per second
        # Read when /metrics is scraped, not written at every change.
        metrics.waiting.set_function(lambda: self.waiting)
        metrics.in_service.set_function(lambda: self._in_service)
        metrics.admission_slots.set_function(lambda: self._slots)

    @property
    def in_service(self) -> int:
        """Return the number of admitted requests not answered yet."""
        return self._in_service

    @property
    def waiting(self) -> int:
        """Return the number of requests waiting for a slot."""
        return len(self._waiting) + len(self._held)

    @property
    def slots(self) -> int:
        """Return how many requests may be in service at once."""
        return self._slots

    @property
    def queue_delay_target_s(self) -> float:
        """Return the longest a request may wait before its batch starts."""
        return self._target_s

    def set_target(self, queue_delay_target_s: float) -> None:
        """Set the queueing-delay target (a new model judged against another SLO); a request
        already waiting is held to the new one from now on."""
        self._target_s = queue_delay_target_s
        self._lifo_after_s = queue_delay_target_s * LIFO_SHARE
        self._service_target_s = queue_delay_target_s * SERVICE_SHARE
        # Refusals are the same every time (the HTTP protocol writes each one's bytes once).
        self._expired = Refusal(
            "queue_delay",
            "the service is overloaded: no service slot freed within the queueing-delay "
            f"target of {queue_delay_target_s * 1000:.0f} ms; retry after {RETRY_AFTER_S} s",
        )

    def start(self) -> None:
        """Bind to the running event loop (for the timer that refuses expired waiters)."""
        self._loop = asyncio.get_running_loop()

    def offer(self, waiter: Waiter, *, early_retry: bool = False) -> None:
        """Admit a request that has just arrived, park it, or refuse it when the room is full.

        ``early_retry``: it came on a connection whose last answer, a 503, asked to retry
        after RETRY_AFTER_S, and that time has not passed. It may take a slot as any other,
        but if it gets none its 503 comes when that Retry-After has passed since its arrival,
        not at the target: a client that retries at once waits for its answer, instead of
        the event loop spending itself on its retries.
        """
        now = time.perf_counter()
        if self._can_admit(now, waiter.arrived, waited_in_room=False):
            self._admit(waiter, now)
            return
        if self.waiting >= self._max_waiting:
            self._refuse(waiter, self._room_full)
            return
        (self._held if early_retry else self._waiting).append(waiter)
        self._window_full = True
        if self._sweep is None:
            self._arm(now)
        elif not early_retry and waiter.arrived + self._target_s < self._sweep_due:
            # The first to wait for the target, behind early retries due at Retry-After.
            self._sweep.cancel()
            self._arm(now)

    def release(self, admitted_at: float, body_read_at: float | None = None) -> None:
        """Free the slot of an answered request, learn from its time, and fill free slots.

        Its time is counted from admission, or from the end of its body when that came later.
        """
        now = time.perf_counter()
        self._in_service -= 1
        elapsed = now - (admitted_at if body_read_at is None else max(admitted_at, body_read_at))
        if self._service_s == 0.0:
            self._service_s = elapsed
        else:
            self._service_s += _SERVICE_WEIGHT * (elapsed - self._service_s)
        self._window_answers += 1
        if now - self._window_start >= self._service_target_s:
            self._adjust(now)
        if self._waiting or self._held:
            self._fill(now)

    # --- internals ----------------------------------------------------------------------------

    def _can_admit(self, now: float, arrived: float, *, waited_in_room: bool) -> bool:
        """Tell whether a request that arrived at ``arrived`` may take a slot now.

        A free slot is taken while the model's queue would let its batch start within the
        target; a request from the waiting room also needs the time an admitted request now
        takes to fit in what is left of the target. An idle service admits any request that
        has not waited the whole target.
        """
        waited = now - arrived
        if self._in_service == 0:
            return waited <= self._target_s
        if self._in_service >= self._slots:
            return False
        expected = self._batcher.expected_delay_s()
        if waited_in_room:
            expected = max(expected, self._service_s)
        return waited + expected <= self._target_s

    def _adjust(self, now: float) -> None:
        """Set the slots to the answer rate of saturated windows times the service share."""
        if self._window_full:
            rate = self._window_answers / (now - self._window_start)
            if self._rate == 0.0:
                self._rate = rate
            else:
                self._rate += _RATE_WEIGHT * (rate - self._rate)
            wanted = self._rate * self._service_target_s
            # At most halve or double at once: one odd window (a GC pause) moves little.
            wanted = min(max(wanted, self._slots / 2), self._slots * 2)
            self._slots = int(min(max(wanted, self._min_slots), self._max_slots))
        self._window_start = now
        self._window_answers = 0
        self._window_full = self._in_service >= self._slots

    def _admit(self, waiter: Waiter, now: float) -> None:
        self._in_service += 1
        if self._in_service >= self._slots:
            self._window_full = True
        self._metrics.admitted.inc()
        self._metrics.admission_wait.observe(now - waiter.arrived)
        waiter.admit(now)

    def _refuse(self, waiter: Waiter, refused: Refusal) -> None:
        self._shed[refused.reason].inc()
        waiter.refuse(refused)

    def _fill(self, now: float) -> None:
        """Give free slots to waiting requests: oldest first, newest first past a standing queue.

        Early retries are taken newest first, as the newest of all when the queue stands.
        """
        waiting, held = self._waiting, self._held
        while waiting or held:
            lifo = not waiting or now - waiting[0].arrived > self._lifo_after_s
            if not lifo:
                room = waiting
                waiter = waiting.popleft()
            else:
                room = (
                    held
                    if not waiting or (held and held[-1].arrived > waiting[-1].arrived)
                    else waiting
                )
                waiter = room.pop()
            if not waiter.alive():
                continue
            if not self._can_admit(now, waiter.arrived, waited_in_room=True):
                # Newest (LIFO) or oldest of a young queue: no other one can do better now.
                if lifo:
                    room.append(waiter)
                else:
                    room.appendleft(waiter)
                break
            self._admit(waiter, now)

    def _arm(self, now: float) -> None:
        """Wake the sweep when the first waiting request is due for its 503."""
        loop = self._loop or asyncio.get_running_loop()
        due = min(
            self._waiting[0].arrived + self._target_s if self._waiting else float("inf"),
            self._held[0].arrived + RETRY_AFTER_S if self._held else float("inf"),
        )
        if due == float("inf"):  # nothing waits
            self._sweep = None
            return
        self._sweep_due = due
        self._sweep = loop.call_later(max(due - now, 0.001), self._expire)

    def _expire(self) -> None:
        """Refuse the requests that waited their whole time (the target, or Retry-After)."""
        self._sweep = None
        now = time.perf_counter()
        for room, patience, refused in (
            (self._waiting, self._target_s, self._expired),
            (self._held, float(RETRY_AFTER_S), self._early_expired),
        ):
            while room and now - room[0].arrived >= patience:
                waiter = room.popleft()
                if waiter.alive():
                    self._refuse(waiter, refused)
        if self._waiting or self._held:
            self._fill(now)
        if self._waiting or self._held:  # what filling the free slots left
            self._arm(now)
