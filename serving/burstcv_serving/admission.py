"""Admit prediction requests into service only as fast as they can be answered within the target.

Under overload the limit is the event loop (reading, parsing, decoding, answering), not only
the model: admitting all the model could batch in time would let hundreds of requests wait
for the loop and every one be answered late. So a request needs one of a limited number of
*service slots*; their number follows the measured answer rate (Little's law, ``_adjust``).

A request that finds every slot taken waits in a *waiting room* as a small object, its body
unread. A freed slot goes to the oldest waiter until the oldest has waited a quarter of the
target, then to the newest (CoDel's sojourn time, adaptive LIFO): past a standing queue the
old ones can no longer be answered in time and the new ones still can. A request that has
waited the whole target is answered 503 with ``Retry-After``, its body unread.

Clients that ignore Retry-After would keep the loop busy refusing, so an *early retry* (sent
on a connection before the Retry-After of its last 503 passed) may still take a slot while
fresh, but otherwise gets its 503 only once Retry-After has passed since its arrival.

The decision is taken as soon as a request's headers are parsed: in ``protocol`` before its
task starts, else in the ASGI middleware. Everything here runs on the event loop: no lock.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from burstcv_serving.batcher import MicroBatcher, moving_average
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

# Share of the target that admitted requests should take from admission to their answer: the
# slot count follows the measured answer rate times it (Little's law). The rest is for the slow
# tail, the wait in the room, and the wait in the socket.
SERVICE_SHARE = 0.25
# Once the oldest waiter has waited this share of the target, slots go newest first (LIFO).
LIFO_SHARE = 0.25
# Weights of the newest sample in the moving averages: of saturated windows' answer rate (a
# few tenths of a second count, so bursts do not swing the slots) and of a request's time.
_RATE_WEIGHT = 0.3
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
        """Start serving it (ADMISSION_WAIT in its scope); AdmissionGate.release when answered."""

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
        # Early retries: they wait up to Retry-After instead of the target.
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
        """Set the queueing-delay target; a request already waiting is held to the new one."""
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
        """Admit a request that has just arrived, park it, or refuse it when the room is full."""
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
        """Free an answered request's slot, learn from its time (from admission, or from the end
        of its body when later), and fill free slots."""
        now = time.perf_counter()
        self._in_service -= 1
        elapsed = now - (admitted_at if body_read_at is None else max(admitted_at, body_read_at))
        self._service_s = moving_average(self._service_s, elapsed, _SERVICE_WEIGHT)
        self._window_answers += 1
        if now - self._window_start >= self._service_target_s:
            self._adjust(now)
        if self._waiting or self._held:
            self._fill(now)

    # --- internals ----------------------------------------------------------------------------

    def _can_admit(self, now: float, arrived: float, *, waited_in_room: bool) -> bool:
        """Tell whether a request that arrived at ``arrived`` may take a slot now: while its batch
        would start within the target (from the room, while the time an admitted request now
        takes fits too); an idle service admits any that has not waited the whole target."""
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
            self._rate = moving_average(self._rate, rate, _RATE_WEIGHT)
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
        """Give free slots to waiters: oldest first (early retries newest first), the newest of
        all past a standing queue."""
        waiting, held = self._waiting, self._held
        while waiting or held:
            lifo = not waiting or now - waiting[0].arrived > self._lifo_after_s
            if lifo:
                newest_held = not waiting or (held and held[-1].arrived > waiting[-1].arrived)
                room = held if newest_held else waiting
                waiter = room.pop()
            else:
                room, waiter = waiting, waiting.popleft()
            if not waiter.alive():
                continue
            if not self._can_admit(now, waiter.arrived, waited_in_room=True):
                # Newest (LIFO) or oldest of a young queue: no other one can do better now.
                (room.append if lifo else room.appendleft)(waiter)
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
