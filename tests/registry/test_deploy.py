"""Deploy against a real service process: promote, refuse, roll back, and undo a failed deploy.

Every test runs ``python -m burstcv_serving`` on a free 127.0.0.1 port over a real registry
written by ``burstcv.registry.Registry``, with tiny real ONNX classifiers. The classifier built
for seed ``n`` answers class ``n`` on any image, so a prediction shows which version computed it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from localserver import LocalServer, free_port, prediction_service
from onnx import numpy_helper

from burstcv.cost.pricing import hourly_price
from burstcv.gate.gate import GateThresholds, ServingContext, judge
from burstcv.gate.latency import drive, staging_service
from burstcv.registry import deploy as deploy_module
from burstcv.registry.deploy import DeployError, deploy, rollback
from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry, RegistryError
from burstcv_spec.contracts import BenchFigures, RegistryDecision

# The serving tests' model builders (real ONNX graphs, model.json as the contract says).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from servingkit import image_bytes, make_classifier_onnx, model_json

MODEL = "digits"
TOKEN = "deploy-test-token"
POLL_S = 0.5  # the service's alias poll: a deploy's reload call should beat it
VERIFY_TIMEOUT_S = 15.0  # generous for a busy 2-core box; a passing deploy returns in < 1 s
FAIL_TIMEOUT_S = 3.0  # how long a deploy that cannot succeed waits before giving up
BENCH_REQUESTS = 30
# The slow model upsamples every image to this side first (4x servingkit's 1024 px): slow
# enough that a busy shared machine cannot blur it into the fast one.
SLOW_SIDE_PX = 2048
IMAGE = image_bytes("PNG", (32, 32))


def slow_classifier_onnx(seed: int, side_px: int = SLOW_SIDE_PX) -> bytes:
    """Return servingkit's slow classifier with its upsampling raised to ``side_px`` squared."""
    model = onnx.load_from_string(make_classifier_onnx(seed, slow=True))
    sizes = next(t for t in model.graph.initializer if t.name == "sizes")
    sizes.CopyFrom(numpy_helper.from_array(np.array([1, 3, side_px, side_px], np.int64), "sizes"))
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_model_dir(folder: Path, seed: int, *, slow: bool = False) -> Path:
    """Write model.onnx + model.json as the export stage does; return the folder."""
    onnx_bytes = slow_classifier_onnx(seed) if slow else make_classifier_onnx(seed)
    return write_raw_model_dir(folder, onnx_bytes)


def write_raw_model_dir(folder: Path, onnx_bytes: bytes) -> Path:
    """Write a model folder whose model.json's sha256 matches whatever bytes are given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(onnx_bytes)
    meta = model_json(None, hashlib.sha256(onnx_bytes).hexdigest())
    (folder / "model.json").write_text(json.dumps(meta))
    return folder


@dataclass
class Service(LocalServer):
    """A running service process, with the questions these tests ask it."""

    def model(self) -> dict[str, Any]:
        """Return GET /v1/model."""
        response = httpx.get(f"{self.url}/v1/model", timeout=5)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def version(self) -> int:
        """Return the version /v1/model reports."""
        return int(self.model()["version"])

    def predicted_label(self) -> str:
        """Return the top class the service answers for a plain image."""
        response = httpx.post(
            f"{self.url}/v1/predict", files={"file": ("x.png", IMAGE, "image/png")}, timeout=10
        )
        assert response.status_code == 200, response.text
        return str(response.json()["predictions"][0]["label"])


@contextlib.contextmanager
def running_service(
    registry: Registry,
    tmp: Path,
    *,
    poll_s: float = POLL_S,
    alias: str = PRODUCTION,
    port: int | None = None,
) -> Iterator[Service]:
    """Run ``python -m burstcv_serving`` on one of the registry's aliases; stop it after."""
    settings = {
        # The registry's root URI: a local folder or s3://bucket/prefix.
        "REGISTRY_URI": registry.root[: -len(MODEL) - 1],
        "MODEL_NAME": MODEL,
        "ALIAS": alias,
        "POLL_INTERVAL_S": poll_s,
        "ADMIN_TOKEN": TOKEN,
        "INTRA_OP_THREADS": 1,
        "MAX_BATCH_SIZE": 4,
    }
    log_path = tmp / f"service-{len(list(tmp.glob('service-*.log')))}.log"  # kept after a run
    with prediction_service(settings, log_path=log_path, port=port) as server:
        yield Service(server.url, server.port, server.process, server.log_path)


def aliases(registry: Registry) -> tuple[int | None, int | None]:
    """Return (production, previous) versions."""
    prod, prev = registry.get_alias(PRODUCTION), registry.get_alias(PREVIOUS)
    return (prod.version if prod else None, prev.version if prev else None)


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    """Return a registry with version 1 (answers class '1') registered and in production."""
    reg = Registry(str(tmp_path / "registry"), MODEL)
    version = reg.register(
        str(write_model_dir(tmp_path / "v1", 1)), RegistryDecision(status="accepted")
    )
    assert version == 1
    reg.promote(1)
    return reg


@pytest.fixture
def service(registry: Registry, tmp_path: Path) -> Iterator[Service]:
    """Run the real service on the registry, serving version 1."""
    with running_service(registry, tmp_path) as svc:
        assert svc.version() == 1
        yield svc


@dataclass
class Measured:
    """A model folder and its latency figures measured through a staging service."""

    folder: Path
    figures: BenchFigures


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    """Measure a fast model (answers '2') and a slow one (answers '1') with real HTTP load."""
    root = tmp_path_factory.mktemp("bench")
    out: dict[str, Measured] = {}
    for name, folder in (
        ("fast", write_model_dir(root / "fast", 2)),
        ("slow", write_model_dir(root / "slow", 1, slow=True)),
    ):
        with staging_service(str(folder), threads=1) as url:
            result = drive(
                url, [IMAGE], requests=BENCH_REQUESTS, concurrency=2, warmup=3, label=name
            )
        assert result.errors == 0, result.status_counts
        # Accuracy is not what this comparison is about: both models score the same.
        out[name] = Measured(folder, result.summary().model_copy(update={"accuracy": 0.95}))
    return out


# -- the gate, with real figures -----------------------------------------------------------------


def test_a_slower_candidate_is_not_promoted(measured: dict[str, Measured]) -> None:
    fast, slow = measured["fast"].figures, measured["slow"].figures
    assert slow.p95_ms > 2 * fast.p95_ms, (fast.p95_ms, slow.p95_ms)
    production = fast.model_copy(update={"version": 1})
    # Within a loose SLO, the regression check against production is what refuses it...
    loose = GateThresholds(
        latency_slo_ms=10_000, accuracy_floor=0.9, max_accuracy_drop=0.02, max_latency_increase=0.2
    )
    verdict = judge(slow, production, loose)
    failed = {c.name for c in verdict.checks if not c.passed}
    assert not verdict.promote and failed == {"no_latency_regression"}
    assert "production v1" in verdict.summary
    # ...and an SLO production meets with 2x headroom refuses it with suggestions priced at
    # the run's prices (us-east-1's, here).
    tight = GateThresholds(2 * fast.p95_ms, accuracy_floor=0.9, max_accuracy_drop=0.02)
    types = ("c7i.large", "c7i.xlarge", "c7i.2xlarge", "g4dn.xlarge", "g5.xlarge", "g6.xlarge")
    prices = {t: hourly_price(t, "us-east-1", "on-demand") for t in types}
    verdict = judge(slow, production, tight, ServingContext(prices=prices))
    assert not verdict.promote and "exceeds the SLO" in verdict.summary
    assert verdict.suggestions and all(s.cost_per_million_usd for s in verdict.suggestions)


def test_a_faster_candidate_is_promoted_and_served(
    measured: dict[str, Measured], tmp_path: Path
) -> None:
    registry = Registry(str(tmp_path / "registry"), MODEL)
    assert registry.register(str(measured["slow"].folder), RegistryDecision(status="accepted")) == 1
    registry.promote(1)
    limits = GateThresholds(
        latency_slo_ms=10_000, accuracy_floor=0.9, max_accuracy_drop=0.02, max_latency_increase=0.2
    )
    production = measured["slow"].figures.model_copy(update={"version": 1})
    verdict = judge(measured["fast"].figures, production, limits)
    assert verdict.promote, verdict.summary
    version = registry.register(
        str(measured["fast"].folder),
        RegistryDecision.model_validate(
            {"status": "accepted", "gate": verdict.model_dump(mode="json")}
        ),
    )
    with running_service(registry, tmp_path) as svc:
        assert svc.predicted_label() == "1"
        result = deploy(
            registry, version, service_urls=[svc.url], token=TOKEN, timeout_s=VERIFY_TIMEOUT_S
        )
        assert (result.version, result.previous_version) == (2, 1)
        assert result.services[svc.url]["version"] == 2
        assert svc.version() == 2 and svc.predicted_label() == "2"
    assert aliases(registry) == (2, 1)


# -- deploy and rollback against a running service ---------------------------------------------


def test_a_rejected_version_is_not_aliased_and_production_keeps_serving(
    registry: Registry, service: Service, tmp_path: Path
) -> None:
    rejected = registry.register(
        str(write_model_dir(tmp_path / "v2", 2)),
        RegistryDecision(status="rejected", reason="p95 too high"),
    )
    seen: list[tuple[int, Any]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                response = client.get(f"{service.url}/v1/model")
                seen.append((response.status_code, response.json().get("version")))
                time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with pytest.raises(RegistryError, match="rejected by the gate: p95 too high"):
            deploy(
                registry,
                rejected,
                service_urls=[service.url],
                token=TOKEN,
                timeout_s=VERIFY_TIMEOUT_S,
            )
        time.sleep(3 * POLL_S)  # several alias polls: the service must not move either
    finally:
        stop.set()
        poller.join()
    assert aliases(registry) == (1, None)
    assert len(seen) >= 10 and set(seen) == {(200, 1)}
    assert service.predicted_label() == "1"


def test_rollback_restores_the_previous_version_in_the_running_service(
    registry: Registry, service: Service, tmp_path: Path
) -> None:
    v2 = registry.register(
        str(write_model_dir(tmp_path / "v2", 2)), RegistryDecision(status="accepted")
    )
    deploy(registry, v2, service_urls=[service.url], token=TOKEN, timeout_s=VERIFY_TIMEOUT_S)
    assert service.version() == 2
    result = rollback(registry, service_urls=[service.url], token=TOKEN, timeout_s=VERIFY_TIMEOUT_S)
    assert (result.version, result.previous_version) == (1, 2)
    assert result.services[service.url]["version"] == 1  # confirmed by the reload answer
    assert service.version() == 1 and service.predicted_label() == "1"
    assert aliases(registry) == (1, 2)
    moves = [
        (e.action, e.alias, e.from_version, e.to_version, e.result) for e in registry.history()
    ]
    assert moves[-2:] == [
        ("rollback", PRODUCTION, 2, 1, "moved"),
        ("rollback", PREVIOUS, 1, 2, "moved"),
    ]


def test_a_version_the_service_cannot_load_never_becomes_production(
    registry: Registry, service: Service, tmp_path: Path
) -> None:
    # The registry accepts it (model.json's sha256 matches the bytes); onnxruntime does not.
    corrupt = registry.register(
        str(write_raw_model_dir(tmp_path / "v2", b"this is not an ONNX model")),
        RegistryDecision(status="accepted"),
    )
    started = time.monotonic()
    with pytest.raises(DeployError) as caught:
        deploy(registry, corrupt, service_urls=[service.url], token=TOKEN, timeout_s=30)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{service.url} cannot serve version 2: HTTP 409: version 2 failed")
    assert "onnxruntime cannot load" in message and message.endswith("left at version 1")
    assert elapsed < 10, f"the service's refusal took {elapsed:.1f}s to arrive"
    assert aliases(registry) == (1, None)
    info = service.model()
    assert info["version"] == 1 and info["last_error"] is None  # the serving state is intact
    assert service.predicted_label() == "1"
    (refusal,) = registry.history()[-1:]
    assert (refusal.from_version, refusal.to_version, refusal.result) == (1, 2, "refused")
    assert "onnxruntime cannot load" in refusal.detail


def test_another_checkouts_registry_cannot_deploy_to_this_service(
    registry: Registry, service: Service, tmp_path: Path
) -> None:
    """The service on the default URL belongs to another registry: it refuses, in one line."""
    other = Registry(str(tmp_path / "other-checkout" / "registry"), MODEL)
    for version in (1, 2):  # a registry whose version 2 would load fine anywhere
        other.register(
            str(write_model_dir(tmp_path / f"o{version}", 3)), RegistryDecision(status="accepted")
        )
    other.promote(1)
    with pytest.raises(DeployError) as caught:
        deploy(other, 2, service_urls=[service.url], token=TOKEN, timeout_s=FAIL_TIMEOUT_S)
    message = str(caught.value)
    assert "\n" not in message
    assert f"this service reads registry {registry.layout.registry_uri}, not " in message
    assert str(tmp_path / "other-checkout" / "registry") in message
    assert aliases(other) == (1, None)  # the deploying registry did not move either
    assert service.version() == 1 and service.predicted_label() == "1"
    staged = httpx.get(
        f"{service.url}/v1/admin/staged", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert staged.json()["staged"] == []  # refused before anything was loaded
    # The service says what it serves, for whoever points a deploy at it.
    info = service.model()
    assert info["name"] == MODEL and info["registry"] == registry.layout.registry_uri


def test_an_unreachable_service_fails_the_deploy_before_production_moves(
    registry: Registry, service: Service, tmp_path: Path
) -> None:
    v2 = registry.register(
        str(write_model_dir(tmp_path / "v2", 2)), RegistryDecision(status="accepted")
    )
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DeployError, match=f"{nobody} cannot serve version 2: ConnectError"):
        deploy(
            registry, v2, service_urls=[service.url, nobody], token=TOKEN, timeout_s=FAIL_TIMEOUT_S
        )
    assert aliases(registry) == (1, None)
    time.sleep(3 * POLL_S)  # several polls: the reachable service staged 2 but never switched
    assert service.version() == 1 and service.predicted_label() == "1"
    staged = httpx.get(
        f"{service.url}/v1/admin/staged", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert staged.json() == {"staged": [2], "serving_version": 1}


def test_a_service_restarting_during_the_deploy_delays_it_and_does_not_fail_it(
    registry: Registry, tmp_path: Path
) -> None:
    v2 = registry.register(
        str(write_model_dir(tmp_path / "v2", 2)), RegistryDecision(status="accepted")
    )
    port = free_port()
    with running_service(registry, tmp_path, port=port) as before:
        assert before.version() == 1
    # The service is down (restarting): the deploy starts while nothing listens on its port.
    outcome: dict[str, Any] = {}

    def deploy_now() -> None:
        try:
            outcome["result"] = deploy(
                registry,
                v2,
                service_urls=[f"http://127.0.0.1:{port}"],
                token=TOKEN,
                timeout_s=VERIFY_TIMEOUT_S,
            )
        except Exception as exc:  # handed to the test's thread below
            outcome["error"] = exc

    caller = threading.Thread(target=deploy_now)
    caller.start()
    time.sleep(1.0)  # the deploy has met a refused connection at least once by now
    assert caller.is_alive(), f"the deploy gave up on a restarting service: {outcome}"
    with running_service(registry, tmp_path, port=port, poll_s=0) as after:
        caller.join(timeout=VERIFY_TIMEOUT_S + 30)
        assert "error" not in outcome, outcome
        assert outcome["result"].version == 2 and outcome["result"].previous_version == 1
        assert after.version() == 2 and after.predicted_label() == "2"
    assert aliases(registry) == (2, 1)


def test_the_reload_call_carries_the_bearer_token(registry: Registry, tmp_path: Path) -> None:
    # With polling off, only an authenticated reload can make the service change versions.
    v2 = registry.register(
        str(write_model_dir(tmp_path / "v2", 2)), RegistryDecision(status="accepted")
    )
    v3 = registry.register(
        str(write_model_dir(tmp_path / "v3", 3)), RegistryDecision(status="accepted")
    )
    with running_service(registry, tmp_path, poll_s=0) as svc:
        deploy(registry, v2, service_urls=[svc.url], token=TOKEN, timeout_s=VERIFY_TIMEOUT_S)
        assert svc.version() == 2
        with pytest.raises(DeployError, match="HTTP 401: invalid admin token; production left at"):
            deploy(registry, v3, service_urls=[svc.url], token="wrong", timeout_s=FAIL_TIMEOUT_S)
        assert svc.version() == 2 and svc.predicted_label() == "2"
        assert aliases(registry) == (2, 1)
        refused = httpx.post(f"{svc.url}/v1/admin/reload", timeout=5)
        assert refused.status_code == 401


def test_a_failed_switch_restores_production_and_every_service_goes_back(
    registry: Registry, tmp_path: Path
) -> None:
    # The second service watches another alias: it stages version 2 like any service, but a
    # reload leaves it on what its alias names, so the switch fails after production moved.
    v2 = registry.register(
        str(write_model_dir(tmp_path / "v2", 2)), RegistryDecision(status="accepted")
    )
    with registry.aliases_locked("test") as writer:
        writer.swap("canary", expect=None, version=1, action="setup")
    with (
        running_service(registry, tmp_path, poll_s=0) as svc,
        running_service(registry, tmp_path, poll_s=0, alias="canary") as canary,
    ):
        with pytest.raises(DeployError) as caught:
            deploy(registry, v2, service_urls=[svc.url, canary.url], token=TOKEN, timeout_s=10.0)
        assert str(caught.value) == (
            f"version 2 failed to switch ({canary.url}: it serves version 1, not 2); "
            "production restored to version 1"
        )
        assert aliases(registry) == (1, None)
        assert svc.version() == 1 and svc.predicted_label() == "1"  # switched, then went back
    moves = [
        (e.action, e.alias, e.from_version, e.to_version, e.result)
        for e in registry.history()
        if e.action != "setup"
    ]
    assert moves[-4:] == [
        ("promote", PRODUCTION, 1, 2, "moved"),
        ("promote", PREVIOUS, None, 1, "moved"),
        ("restore", PRODUCTION, 2, 1, "moved"),
        ("restore", PREVIOUS, 1, None, "moved"),
    ]


def test_deploys_under_load_drop_no_request(registry: Registry, tmp_path: Path) -> None:
    # The two-phase deploy keeps the hot swap's promise: clients see no failed request and
    # every answer comes from a version that production named at some moment.
    versions = [
        registry.register(
            str(write_model_dir(tmp_path / f"v{seed}", seed)), RegistryDecision(status="accepted")
        )
        for seed in (2, 3, 4)
    ]
    answers: list[tuple[int, int | None, str | None]] = []
    stop = threading.Event()

    def hammer(url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not stop.is_set():
                response = client.post("/v1/predict", files={"file": ("x.png", IMAGE, "image/png")})
                body = response.json() if response.status_code == 200 else {}
                label = body["predictions"][0]["label"] if body else None
                answers.append((response.status_code, body.get("version"), label))

    with running_service(registry, tmp_path) as svc:
        clients = [threading.Thread(target=hammer, args=(svc.url,)) for _ in range(4)]
        for thread in clients:
            thread.start()
        try:
            for version in versions:
                time.sleep(0.3)
                deploy(registry, version, service_urls=[svc.url], token=TOKEN, timeout_s=30)
                assert svc.version() == version
            time.sleep(0.3)
        finally:
            stop.set()
            for thread in clients:
                thread.join()
    failures = [a for a in answers if a[0] != 200]
    assert len(answers) > 50 and failures == [], failures[:3]
    assert {version for _, version, _ in answers} == {1, *versions}
    assert all(label == str((version or 0) % 10) for _, version, label in answers)


# -- the deploy's decisions, against in-process stand-in services ------------------------------


@dataclass
class Answer:
    """What a stand-in service answers one call with (after ``delay_s``)."""

    status: int = 200
    body: Any = None  # a dict is sent as JSON, a str as text/plain
    delay_s: float = 0.0
    together: threading.Barrier | None = None  # answer only once every party has been called


class FakeService:
    """A stand-in serving process: answers stage and reload as scripted, records every call.

    By default it stages anything and, on reload, serves what production names (as the real
    service does); ``stage`` / ``reload`` answers queued here are used first, in order.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.stage: list[Answer] = []
        self.reload: list[Answer] = []
        self.stage_always: Answer | None = None
        self.reload_always: Answer | None = None
        self.calls: list[tuple[str, Any, str]] = []  # path, JSON body, Authorization
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fake.answer(self, raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self) -> list[str]:
        """Return the paths called, in order."""
        return [path for path, _, _ in self.calls]

    def answer(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        path = handler.path
        with self.lock:
            self.calls.append(
                (path, json.loads(raw) if raw else None, handler.headers.get("Authorization", ""))
            )
            queue, always = (
                (self.stage, self.stage_always)
                if path.endswith("/stage")
                else (self.reload, self.reload_always)
            )
            scripted = queue.pop(0) if queue else always
        if scripted is None:
            body = json.loads(raw) if path.endswith("/stage") else None
            prod = self.registry.get_alias(PRODUCTION)
            scripted = Answer(body={"version": body["version"] if body else prod.version})
        time.sleep(scripted.delay_s)
        if scripted.together is not None:
            try:
                scripted.together.wait()
            except threading.BrokenBarrierError:
                scripted = Answer(500, {"detail": "called alone: the calls were not in parallel"})
        text = scripted.body if isinstance(scripted.body, str) else json.dumps(scripted.body)
        data = text.encode()
        try:
            handler.send_response(scripted.status)
            kind = "text/plain" if isinstance(scripted.body, str) else "application/json"
            handler.send_header("Content-Type", kind)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:
            pass  # the caller gave up waiting

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes(registry: Registry) -> Iterator[list[FakeService]]:
    """Return two stand-in services for the registry (production on version 1)."""
    made = [FakeService(registry), FakeService(registry)]
    yield made
    for fake in made:
        fake.close()


class VirtualClock:
    """Stand in for the deploy module's ``time``: sleeps advance a clock instead of waiting."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """Make the deploy's retries wait on a virtual clock (calls still go over real HTTP)."""
    virtual = VirtualClock()
    monkeypatch.setattr(deploy_module, "time", virtual)
    return virtual


def register(registry: Registry, tmp_path: Path, seed: int, status: str = "accepted") -> int:
    """Register a real classifier for ``seed`` and return its version."""
    return registry.register(
        str(write_model_dir(tmp_path / f"v{seed}-{status}", seed)),
        RegistryDecision.model_validate(
            {"status": status, "reason": "" if status == "accepted" else "p95 too high"}
        ),
    )


def test_a_deploy_stages_everywhere_then_switches_every_service(
    registry: Registry, fakes: list[FakeService], tmp_path: Path
) -> None:
    v2 = register(registry, tmp_path, 2)
    urls = [f.url + "/" for f in fakes]  # a trailing slash is tolerated
    result = deploy(registry, v2, service_urls=urls, token=TOKEN, timeout_s=VERIFY_TIMEOUT_S)
    assert result.model_dump(mode="json") == {
        "version": 2,
        "previous_version": 1,
        "services": {f.url: {"version": 2} for f in fakes},
        "staged": {f.url: {"version": 2} for f in fakes},
    }
    assert aliases(registry) == (2, 1)
    whose = {"registry": str((tmp_path / "registry").resolve()), "model": MODEL}
    for fake in fakes:  # asked once each: stage (saying whose model), then reload
        assert fake.calls == [
            (
                "/v1/admin/stage",
                {"version": 2, "sha256": registry.model_card(2).sha256, **whose},
                f"Bearer {TOKEN}",
            ),
            ("/v1/admin/reload", None, f"Bearer {TOKEN}"),
        ]


def test_services_stage_in_parallel(
    registry: Registry, fakes: list[FakeService], tmp_path: Path
) -> None:
    v2 = register(registry, tmp_path, 2)
    both_asked = threading.Barrier(2, timeout=5)  # each answers once the other is asked too
    for fake in fakes:
        fake.stage.append(Answer(body={"version": 2}, together=both_asked))
    result = deploy(registry, v2, service_urls=[f.url for f in fakes], token=TOKEN, timeout_s=10)
    assert result.version == 2 and aliases(registry) == (2, 1)


def test_with_no_service_configured_only_the_registry_moves(
    registry: Registry, tmp_path: Path
) -> None:
    v2 = register(registry, tmp_path, 2)
    result = deploy(registry, v2, service_urls=[], token=TOKEN, timeout_s=1)
    assert (result.version, result.previous_version, result.services, result.staged) == (
        2,
        1,
        {},
        {},
    )
    assert aliases(registry) == (2, 1)


def test_a_refusal_ends_the_deploy_without_waiting_for_slower_services(
    registry: Registry, fakes: list[FakeService], tmp_path: Path
) -> None:
    v2 = register(registry, tmp_path, 2)
    refusing, slow = fakes
    refusing.stage.append(Answer(409, {"detail": "version 2 failed:\n  out of memory"}))
    slow.stage.append(Answer(delay_s=4.0, body={"version": 2}))
    started = time.monotonic()
    with pytest.raises(DeployError) as caught:
        deploy(registry, v2, service_urls=[refusing.url, slow.url], token=TOKEN, timeout_s=10)
    assert time.monotonic() - started < 3.0
    assert str(caught.value) == (
        f"{refusing.url} cannot serve version 2: HTTP 409: version 2 failed: out of memory; "
        "production left at version 1"
    )
    assert aliases(registry) == (1, None)
    assert "/v1/admin/reload" not in refusing.paths() + slow.paths()


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (Answer(500, "disk full\n"), "HTTP 500: disk full"),
        (Answer(500, ""), "HTTP 500: Internal Server Error"),
        (Answer(422, {"detail": [{"msg": "bad"}]}), 'HTTP 422: {"detail": [{"msg": "bad"}]}'),
    ],
)
def test_a_refusal_quotes_the_service_in_one_line(
    registry: Registry, fakes: list[FakeService], tmp_path: Path, answer: Answer, words: str
) -> None:
    v2 = register(registry, tmp_path, 2)
    fakes[0].stage.append(answer)
    with pytest.raises(DeployError) as caught:
        deploy(registry, v2, service_urls=[fakes[0].url], token=TOKEN, timeout_s=5)
    assert str(caught.value) == (
        f"{fakes[0].url} cannot serve version 2: {words}; production left at version 1"
    )
    (refusal,) = registry.history()[-1:]
    assert (refusal.from_version, refusal.to_version, refusal.result) == (1, 2, "refused")


def test_a_busy_service_is_called_again_with_growing_waits(
    registry: Registry, fakes: list[FakeService], tmp_path: Path, clock: VirtualClock
) -> None:
    v2 = register(registry, tmp_path, 2)
    busy = fakes[0]
    busy.stage.extend([Answer(503, {"detail": "loading"})] * 6)
    result = deploy(registry, v2, service_urls=[busy.url], token=TOKEN, timeout_s=30)
    assert result.version == 2 and aliases(registry) == (2, 1)
    assert clock.sleeps == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]  # doubling, at most 2 s
    assert busy.paths() == ["/v1/admin/stage"] * 7 + ["/v1/admin/reload"]


def test_a_service_still_busy_at_the_timeout_refuses_with_its_last_answer(
    registry: Registry, fakes: list[FakeService], tmp_path: Path, clock: VirtualClock
) -> None:
    v2 = register(registry, tmp_path, 2)
    busy = fakes[0]
    busy.stage_always = Answer(503, {"detail": "shedding load"})
    # Calls at 0, 0.25 and 0.75 s; the next would come at 1.75 s, the deadline: it is not made.
    with pytest.raises(DeployError, match=r"HTTP 503: shedding load; production left at version 1"):
        deploy(registry, v2, service_urls=[busy.url], token=TOKEN, timeout_s=1.75)
    assert clock.sleeps == [0.25, 0.5] and len(busy.calls) == 3
    assert aliases(registry) == (1, None)


def test_a_service_that_never_listens_is_given_up_on_at_the_timeout(
    registry: Registry, tmp_path: Path, clock: VirtualClock
) -> None:
    v2 = register(registry, tmp_path, 2)
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(DeployError) as caught:
        deploy(registry, v2, service_urls=[nobody], token=TOKEN, timeout_s=1.75)
    message = str(caught.value)
    assert message.startswith(f"{nobody} cannot serve version 2: ConnectError")
    assert message.endswith("(3 tries over 1.75 s); production left at version 1")
    assert clock.sleeps == [0.25, 0.5]
    assert aliases(registry) == (1, None)


def test_every_call_gets_at_least_half_a_second_to_answer(
    registry: Registry, fakes: list[FakeService], tmp_path: Path
) -> None:
    v2 = register(registry, tmp_path, 2)
    prompt, slow = fakes
    prompt.stage.append(Answer(delay_s=0.2, body={"version": 2}))
    assert deploy(registry, v2, service_urls=[prompt.url], token=TOKEN, timeout_s=0.01).version == 2
    v3 = register(registry, tmp_path, 3)
    slow.stage.append(Answer(delay_s=0.65, body={"version": 3}))
    with pytest.raises(DeployError, match=f"{slow.url} cannot serve version 3: ReadTimeout"):
        deploy(registry, v3, service_urls=[slow.url], token=TOKEN, timeout_s=0.01)
    assert aliases(registry) == (2, 1)


def test_a_failed_switch_puts_production_back_and_switches_every_service_back(
    registry: Registry, fakes: list[FakeService], tmp_path: Path
) -> None:
    v2 = register(registry, tmp_path, 2)
    good, stuck = fakes
    stuck.reload_always = Answer(body={"version": 1})  # it keeps serving version 1
    with pytest.raises(DeployError) as caught:
        deploy(registry, v2, service_urls=[good.url, stuck.url], token=TOKEN, timeout_s=5)
    assert str(caught.value) == (
        f"version 2 failed to switch ({stuck.url}: it serves version 1, not 2); "
        "production restored to version 1"
    )
    assert aliases(registry) == (1, None)
    # Both are told to reload again: the good one had switched to 2 and must come back.
    assert good.paths() == ["/v1/admin/stage", "/v1/admin/reload", "/v1/admin/reload"]
    assert stuck.paths() == ["/v1/admin/stage", "/v1/admin/reload", "/v1/admin/reload"]


def test_a_failed_first_deploy_unsets_production_and_reloads_nothing_more(
    tmp_path: Path,
) -> None:
    reg = Registry(str(tmp_path / "registry"), MODEL)
    v1 = register(reg, tmp_path, 1)
    fake = FakeService(reg)
    try:
        fake.reload_always = Answer(503, {"detail": "no model yet"})
        with pytest.raises(DeployError, match=r"; production restored to nothing$"):
            deploy(reg, v1, service_urls=[fake.url], token=TOKEN, timeout_s=0.01)
        assert aliases(reg) == (None, None)
        assert fake.paths() == ["/v1/admin/stage", "/v1/admin/reload"]
    finally:
        fake.close()


def test_redeploying_production_that_a_service_does_not_serve_says_so(
    registry: Registry, fakes: list[FakeService]
) -> None:
    fakes[0].reload_always = Answer(body={"version": 7})
    with pytest.raises(DeployError) as caught:
        deploy(registry, 1, service_urls=[fakes[0].url], token=TOKEN, timeout_s=5)
    assert str(caught.value) == (
        f"version 1 is production but not served: {fakes[0].url}: it serves version 7, not 1"
    )
    assert aliases(registry) == (1, None)  # nothing to put back


def test_a_rejected_version_is_refused_before_any_service_is_called(
    registry: Registry, fakes: list[FakeService], tmp_path: Path
) -> None:
    rejected = register(registry, tmp_path, 2, status="rejected")
    with pytest.raises(RegistryError, match="rejected by the gate: p95 too high"):
        deploy(registry, rejected, service_urls=[fakes[0].url], token=TOKEN, timeout_s=5)
    assert fakes[0].calls == [] and aliases(registry) == (1, None)
    refusal = registry.history()[-1]
    assert (refusal.from_version, refusal.to_version, refusal.result) == (1, 2, "refused")


def test_rollback_returns_to_a_previous_version_even_one_the_gate_rejected(
    tmp_path: Path,
) -> None:
    reg = Registry(str(tmp_path / "registry"), MODEL)
    forced = register(reg, tmp_path, 1, status="rejected")
    reg.promote(forced, force=True)  # an operator's explicit call
    fake = FakeService(reg)
    try:
        deploy(reg, register(reg, tmp_path, 2), service_urls=[fake.url], token=TOKEN, timeout_s=5)
        result = rollback(reg, service_urls=[fake.url], token=TOKEN, timeout_s=5)
    finally:
        fake.close()
    assert (result.version, result.previous_version) == (1, 2)
    assert result.services == {fake.url: {"version": 1}}
    assert aliases(reg) == (1, 2)


def test_rollback_without_a_previous_version_calls_no_service(
    registry: Registry, fakes: list[FakeService]
) -> None:
    with pytest.raises(RegistryError, match="digits has no previous version to roll back to"):
        rollback(registry, service_urls=[fakes[0].url], token=TOKEN, timeout_s=5)
    assert fakes[0].calls == [] and aliases(registry) == (1, None)
