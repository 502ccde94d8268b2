"""The admin door: off loopback, the service refuses a placeholder, empty or short token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from burstcv_serving.settings import PLACEHOLDER_ADMIN_TOKEN, Settings

STRONG = "kq3N8xVt2pL9wR4zY7bC1dF6"  # 24 characters


@pytest.mark.parametrize("environment", ["development", "staging", "production"])
@pytest.mark.parametrize(
    ("token", "why"),
    [
        (PLACEHOLDER_ADMIN_TOKEN, "the development placeholder"),
        ("short-token", "11 characters long"),
    ],
)
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "serving.internal"])
def test_a_weak_token_is_refused_off_loopback_whatever_the_environment(
    host: str, token: str, why: str, environment: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(host=host, admin_token=token, environment=environment)  # type: ignore[arg-type]
    (message,) = [
        str(e["msg"]) for e in caught.value.errors() if "refusing to listen" in str(e["msg"])
    ]
    assert f"refusing to listen on {host}" in message and why in message
    assert "\n" not in message


def test_an_empty_token_is_refused_everywhere() -> None:
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ValidationError, match="must not be empty"):
            Settings(host=host, admin_token="")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_keeps_the_developer_default(host: str) -> None:
    assert Settings(host=host).admin_token == PLACEHOLDER_ADMIN_TOKEN


def test_a_strong_token_may_listen_anywhere() -> None:
    settings = Settings(host="0.0.0.0", admin_token=STRONG)
    assert settings.host == "0.0.0.0"
    short_by_one = STRONG[:15]
    with pytest.raises(ValidationError, match="15 characters long"):
        Settings(host="0.0.0.0", admin_token=short_by_one)
    assert Settings(host="0.0.0.0", admin_token=STRONG[:16]).admin_token == STRONG[:16]


def test_the_service_process_refuses_to_start_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BURSTCV_SERVING_")}
    env.update(BURSTCV_SERVING_HOST="0.0.0.0", BURSTCV_SERVING_PORT="0")
    result = subprocess.run(
        [sys.executable, "-m", "burstcv_serving"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("burstcv-serving: not starting: refusing to listen on 0.0.0.0")
    assert "development placeholder" in lines[0]
