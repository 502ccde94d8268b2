"""Define the service's Prometheus metrics in a registry owned by one app instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
Labels = tuple[str, ...]
Buckets = tuple[float, ...]
SHED_REASONS = ("queue_delay", "early_retry", "queue_full", "deadline", "no_model")


class ServiceMetrics:
    """Hold every metric the service exports; one instance per app, so tests can build many."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = self._counter(
            "burstcv_serving_requests",
            "HTTP requests answered, by route, method and status code.",
            ("path", "method", "status"),
        )
        self.latency = self._histogram(
            "burstcv_serving_request_duration_seconds",
            "Time from receiving a request to sending its response.",
            ("path",),
        )
        self.batch_size = self._histogram(
            "burstcv_serving_batch_size",
            "Images per onnxruntime session.run call.",
            buckets=_BATCH_BUCKETS,
        )
        self.inference = self._histogram(
            "burstcv_serving_inference_duration_seconds",
            "Time of one batch: normalisation, session.run and softmax.",
        )
        self.queue_depth = self._gauge(
            "burstcv_serving_queue_depth", "Images waiting for inference."
        )
        self.admitted = self._counter(
            "burstcv_serving_admitted_requests",
            "Prediction requests given a service slot (their body then read, decoded, queued).",
        )
        self.shed = self._counter(
            "burstcv_serving_shed_requests",
            "Prediction requests refused with 503 and Retry-After, by reason: queue_delay "
            "(waited the queueing-delay target for a slot; the body never read), early_retry "
            "(came back before the Retry-After of the 503 before it on its connection, and "
            "waited that long for a slot in vain; the body never read), queue_full "
            "(the waiting room, or the inference queue, full), deadline (admitted, but its "
            "batch could not start within the target of its arrival), no_model (none loaded).",
            ("reason",),
        )
        for reason in SHED_REASONS:
            self.shed.labels(reason=reason)  # exported at 0 from the start, for rate()
        self.queue_delay = self._histogram(
            "burstcv_serving_queue_delay_seconds",
            "Queueing delay of a prediction request: its wait for a service slot plus its "
            "wait in the inference queue, until its batch started.",
        )
        self.admission_wait = self._histogram(
            "burstcv_serving_admission_wait_seconds",
            "Time an admitted prediction request waited for a service slot.",
        )
        self.waiting = self._gauge(
            "burstcv_serving_waiting_requests",
            "Prediction requests waiting for a service slot (their body not read yet).",
        )
        self.admission_slots = self._gauge(
            "burstcv_serving_admission_slots",
            "Prediction requests that may be in service at once: the measured answer rate "
            "times a quarter of the queueing-delay target, within bounds.",
        )
        self.in_service = self._gauge(
            "burstcv_serving_in_service_requests",
            "Prediction requests admitted and not answered yet (at most the service slots).",
        )
        self.model_info = self._gauge(
            "burstcv_serving_model_info",
            "1 for the model version now serving.",
            ("name", "version", "sha256"),
        )
        self.model_loads = self._counter(
            "burstcv_serving_model_loads",
            "Model load attempts, by outcome (loaded or failed).",
            ("outcome",),
        )

    def _counter(self, name: str, documentation: str, labels: Labels = ()) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def _gauge(self, name: str, documentation: str, labels: Labels = ()) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def _histogram(
        self, name: str, documentation: str, labels: Labels = (), buckets: Buckets = _LATENCY_S
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def set_serving(self, name: str, version: int | str, sha256: str) -> None:
        """Point the model_info gauge at the version now serving (and only at it)."""
        self.model_info.clear()
        self.model_info.labels(name=name, version=str(version), sha256=sha256).set(1)
