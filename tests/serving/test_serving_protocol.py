"""The one door to the fast HTTP protocol: a probe of uvicorn, a setting, and the public fallback.

The shedding behaviour itself runs with both protocols in test_serving_overload.py.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from servingkit import Registry, make_settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from burstcv_serving import protocol
from burstcv_serving.main import create_app

REQUIREMENTS = Path(__file__).resolve().parents[2] / "serving" / "requirements.txt"


def _pinned_uvicorn() -> str:
    match = re.search(r"^uvicorn==(\S+)$", REQUIREMENTS.read_text(), re.MULTILINE)
    assert match, "serving/requirements.txt pins no uvicorn"
    return match.group(1)


def test_the_protocol_is_written_for_the_uvicorn_the_service_pins() -> None:
    assert _pinned_uvicorn() == protocol.WRITTEN_FOR_UVICORN


def test_the_pinned_uvicorn_gets_the_fast_protocol(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(make_settings(registry))
    with caplog.at_level(logging.INFO, logger=protocol.__name__):
        chosen = protocol.protocol_for(app)
    assert protocol.fast_path_mismatch() is None
    assert isinstance(chosen, type) and issubclass(chosen, protocol.AdmissionHttpProtocol)
    assert chosen.app_of_service is app
    assert not caplog.records


def _another_uvicorn(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    return "uvicorn is 0.99.0"


def _no_start_asgi_task(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    return "has no _start_asgi_task"


def _another_signature(monkeypatch: pytest.MonkeyPatch) -> str:
    def _start_asgi_task(self: Any, cycle: Any, app: Any, context: Any) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(HttpToolsProtocol, "_start_asgi_task", _start_asgi_task)
    return "takes ('self', 'cycle', 'app', 'context')"


@pytest.mark.parametrize("mismatch", [_another_uvicorn, _no_start_asgi_task, _another_signature])
def test_a_uvicorn_the_protocol_was_not_written_for_gets_the_public_one_and_one_warning(
    registry: Registry,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    mismatch: Any,
) -> None:
    reason = mismatch(monkeypatch)
    app = create_app(make_settings(registry))
    with caplog.at_level(logging.INFO, logger=protocol.__name__):
        chosen = protocol.protocol_for(app)
    assert chosen == "httptools"
    assert reason in (protocol.fast_path_mismatch() or "")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert reason in record.getMessage()
    assert "uvicorn's httptools protocol" in record.getMessage()


def test_the_setting_turns_the_fast_protocol_off(
    registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(make_settings(registry, fast_protocol=False))
    with caplog.at_level(logging.INFO, logger=protocol.__name__):
        assert protocol.protocol_for(app) == "httptools"
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # an operator's choice
