"""The compose stack's settings: the secrets check, the UI passwords, and the .env writer.

airflow-init runs ``burstcv check-stack`` and ``burstcv stack-passwords`` (src/burstcv/stack.py)
with the container environment docker-compose.yaml gives it; ``make stack-env`` writes the .env
that environment comes from (docker/stack-env.py).
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from burstcv.cli import app
from burstcv.stack import stack_problems, users, write_passwords

REPO = Path(__file__).resolve().parents[2]
STACK_ENV = REPO / "docker" / "stack-env.py"
COMPOSE = REPO / "docker-compose.yaml"
# The secrets docker/stack-env.py generates (docker-compose.yaml requires each).
SECRETS = (
    "AIRFLOW_FERNET_KEY",
    "AIRFLOW_JWT_SECRET",
    "AIRFLOW_ADMIN_PASSWORD",
    "POSTGRES_PASSWORD",
    "BURSTCV_SERVING_ADMIN_TOKEN",
)
USERS = "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"
_SUBSTITUTION = re.compile(r"\$\$|\$\{([A-Z0-9_]+)(?:(:?[-?])([^}]*))?\}")


def fernet_key(n_bytes: int = 32) -> str:
    return base64.urlsafe_b64encode(os.urandom(n_bytes)).decode()


def good_env(**changes: str) -> dict[str, str]:
    """Return the container environment of a sound local stack, with ``changes``."""
    env = {
        "AIRFLOW__CORE__FERNET_KEY": fernet_key(),
        "AIRFLOW__API_AUTH__JWT_SECRET": "j" * 32,
        "BURSTCV_SERVING_ADMIN_TOKEN": "t" * 16,
        "AIRFLOW_ADMIN_PASSWORD": "p" * 12,
        "BURSTCV_COMPUTE_BACKEND": "local",
        "BURSTCV_ARTIFACT_ROOT": "",
        "BURSTCV_EC2_INSTANCE_PROFILE": "",
    }
    return {**env, **changes}


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Clear the variables the stack check reads (the test session's and this machine's)."""
    for name in list(os.environ):
        if name.startswith(("BURSTCV_", "AWS_")) or name in good_env() or name == USERS:
            monkeypatch.delenv(name)
    return monkeypatch


def run_stack_env(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(STACK_ENV), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


def read_dotenv(path: Path) -> dict[str, str]:
    """Return NAME=VALUE lines of a .env file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"{path}: not NAME=VALUE: {line!r}"
            out[name] = value
    return out


def container_env(service: str, dotenv: Mapping[str, str]) -> dict[str, str]:
    """Return a service's environment as compose builds it from docker-compose.yaml and .env."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2), match.group(3)
        value = dotenv.get(name)
        if op in (":-", ":?") and not value:
            value = None
        if value is not None:
            return value
        assert op not in (":?", "?"), f"compose refuses to start without {name}"
        return arg if op in (":-", "-") else ""

    compose = yaml.safe_load(COMPOSE.read_text())
    env = compose["services"][service]["environment"]
    return {k: _SUBSTITUTION.sub(one, str(v)) for k, v in env.items()}


def test_a_stack_env_made_by_stack_env_passes_the_check(
    clean_environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    out = tmp_path / ".env"
    run_stack_env("--out", str(out))
    env = container_env("airflow-init", read_dotenv(out))
    assert stack_problems(env) == []
    # The same stack set to train on EC2: refused until it names its store and profile.
    ec2 = tmp_path / "ec2.env"
    run_stack_env("--out", str(ec2), "BURSTCV_COMPUTE_BACKEND=ec2")
    problems = stack_problems(container_env("airflow-init", read_dotenv(ec2)))
    assert len(problems) == 2 and "BURSTCV_ARTIFACT_ROOT" in problems[0]
    assert "BURSTCV_EC2_INSTANCE_PROFILE" in problems[1]
    complete = tmp_path / "ec2-complete.env"
    run_stack_env(
        "--out",
        str(complete),
        "BURSTCV_COMPUTE_BACKEND=ec2",
        "BURSTCV_ARTIFACT_ROOT=s3://bucket/burstcv",
        "BURSTCV_EC2_INSTANCE_PROFILE=burstcv-box",
    )
    assert stack_problems(container_env("airflow-init", read_dotenv(complete))) == []


def test_the_limits_themselves_pass(clean_environ: pytest.MonkeyPatch) -> None:
    # 32-character JWT secret, 16-character token, 12-character password: just enough.
    assert stack_problems(good_env()) == []
    # The admin password is checked only where it is given (airflow-init's environment).
    without = good_env()
    del without["AIRFLOW_ADMIN_PASSWORD"]
    assert stack_problems(without) == []


@pytest.mark.parametrize(
    ("changes", "variable"),
    [
        pytest.param(
            {"AIRFLOW__CORE__FERNET_KEY": ""}, "AIRFLOW__CORE__FERNET_KEY", id="fernet-empty"
        ),
        pytest.param(
            {"AIRFLOW__CORE__FERNET_KEY": "not base64!"},
            "AIRFLOW__CORE__FERNET_KEY",
            id="fernet-not-base64",
        ),
        pytest.param(
            {"AIRFLOW__CORE__FERNET_KEY": fernet_key(16)},
            "AIRFLOW__CORE__FERNET_KEY",
            id="fernet-16-bytes",
        ),
        pytest.param(
            {"AIRFLOW__CORE__FERNET_KEY": fernet_key(33)},
            "AIRFLOW__CORE__FERNET_KEY",
            id="fernet-33-bytes",
        ),
        pytest.param(
            {"AIRFLOW__API_AUTH__JWT_SECRET": "j" * 31},
            "AIRFLOW__API_AUTH__JWT_SECRET",
            id="jwt-short",
        ),
        pytest.param(
            {"AIRFLOW__API_AUTH__JWT_SECRET": "change-me"},
            "AIRFLOW__API_AUTH__JWT_SECRET",
            id="jwt-placeholder",
        ),
        pytest.param(
            {"AIRFLOW__API_AUTH__JWT_SECRET": ""}, "AIRFLOW__API_AUTH__JWT_SECRET", id="jwt-empty"
        ),
        pytest.param(
            {"BURSTCV_SERVING_ADMIN_TOKEN": "t" * 15},
            "BURSTCV_SERVING_ADMIN_TOKEN",
            id="token-short",
        ),
        pytest.param(
            {"BURSTCV_SERVING_ADMIN_TOKEN": "dev-token"},
            "BURSTCV_SERVING_ADMIN_TOKEN",
            id="token-placeholder",
        ),
        pytest.param(
            {"BURSTCV_SERVING_ADMIN_TOKEN": ""}, "BURSTCV_SERVING_ADMIN_TOKEN", id="token-empty"
        ),
        pytest.param(
            {"AIRFLOW_ADMIN_PASSWORD": "p" * 11}, "AIRFLOW_ADMIN_PASSWORD", id="password-short"
        ),
        pytest.param(
            {"AIRFLOW_ADMIN_PASSWORD": "admin"}, "AIRFLOW_ADMIN_PASSWORD", id="password-placeholder"
        ),
        pytest.param(
            {"BURSTCV_COMPUTE_BACKEND": "ec2", "BURSTCV_EC2_INSTANCE_PROFILE": "burstcv-box"},
            "BURSTCV_ARTIFACT_ROOT",
            id="ec2-without-artifact-root",
        ),
        pytest.param(
            {
                "BURSTCV_COMPUTE_BACKEND": "ec2",
                "BURSTCV_ARTIFACT_ROOT": "/opt/burstcv/artifacts",
                "BURSTCV_EC2_INSTANCE_PROFILE": "burstcv-box",
            },
            "BURSTCV_ARTIFACT_ROOT",
            id="ec2-with-local-artifact-root",
        ),
        pytest.param(
            {"BURSTCV_COMPUTE_BACKEND": "ec2", "BURSTCV_ARTIFACT_ROOT": "s3://bucket/burstcv"},
            "BURSTCV_EC2_INSTANCE_PROFILE",
            id="ec2-without-instance-profile",
        ),
    ],
)
def test_each_problem_is_reported_by_its_variable(
    clean_environ: pytest.MonkeyPatch, changes: dict[str, str], variable: str
) -> None:
    problems = stack_problems(good_env(**changes))
    assert len(problems) == 1, problems
    assert variable in problems[0], problems


def test_every_problem_is_reported_at_once(clean_environ: pytest.MonkeyPatch) -> None:
    env = good_env(
        AIRFLOW__CORE__FERNET_KEY="",
        AIRFLOW__API_AUTH__JWT_SECRET="secret",
        BURSTCV_SERVING_ADMIN_TOKEN="short",
        AIRFLOW_ADMIN_PASSWORD="short",
        BURSTCV_COMPUTE_BACKEND="ec2",
    )
    problems = stack_problems(env)
    for variable in (
        "AIRFLOW__CORE__FERNET_KEY",
        "AIRFLOW__API_AUTH__JWT_SECRET",
        "BURSTCV_SERVING_ADMIN_TOKEN",
        "AIRFLOW_ADMIN_PASSWORD",
        "BURSTCV_ARTIFACT_ROOT",
        "BURSTCV_EC2_INSTANCE_PROFILE",
    ):
        assert [p for p in problems if variable in p], (variable, problems)
    assert len(problems) == 6, problems


def test_the_check_reads_the_process_environment(clean_environ: pytest.MonkeyPatch) -> None:
    for name, value in good_env(AIRFLOW__API_AUTH__JWT_SECRET="short").items():
        clean_environ.setenv(name, value)
    problems = stack_problems()
    assert len(problems) == 1 and "AIRFLOW__API_AUTH__JWT_SECRET" in problems[0]


def test_check_stack_fails_listing_every_problem(clean_environ: pytest.MonkeyPatch) -> None:
    bad = good_env(
        AIRFLOW__CORE__FERNET_KEY=fernet_key(16),
        BURSTCV_SERVING_ADMIN_TOKEN="dev-token",
        BURSTCV_COMPUTE_BACKEND="ec2",
        BURSTCV_ARTIFACT_ROOT="s3://bucket/burstcv",
    )
    for name, value in bad.items():
        clean_environ.setenv(name, value)
    result = CliRunner().invoke(app, ["check-stack"])
    assert result.exit_code != 0, result.output
    for problem in stack_problems(bad):
        assert problem in result.output
    for variable in (
        "AIRFLOW__CORE__FERNET_KEY",
        "BURSTCV_SERVING_ADMIN_TOKEN",
        "BURSTCV_EC2_INSTANCE_PROFILE",
    ):
        assert variable in result.output
    assert "3 problem(s)" in result.output and "stack-env" in result.output


def test_check_stack_passes_a_sound_stack(clean_environ: pytest.MonkeyPatch) -> None:
    for name, value in good_env().items():
        clean_environ.setenv(name, value)
    result = CliRunner().invoke(app, ["check-stack"])
    assert result.exit_code == 0, result.output
    assert "problem" not in result.output


def test_users_reads_the_simple_auth_manager_setting() -> None:
    assert users("alice:admin, bob:viewer,") == ["alice", "bob"]
    assert users("admin:admin") == ["admin"]
    assert users("") == []


def test_write_passwords_gives_each_user_a_password(tmp_path: Path) -> None:
    path = tmp_path / "auth" / "passwords.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"admin": "the-old-admin-pw", "bob": "bobs-own-pw", "gone": "x"}))
    path.chmod(0o644)
    env = {USERS: "admin:admin,bob:viewer,carol:op", "AIRFLOW_ADMIN_PASSWORD": "new-admin-pw-123"}
    assert write_passwords(path, env) == ["admin", "bob", "carol"]
    passwords = json.loads(path.read_text())
    assert passwords["admin"] == "new-admin-pw-123"  # the first user: AIRFLOW_ADMIN_PASSWORD
    assert passwords["bob"] == "bobs-own-pw"  # kept
    assert len(passwords["carol"]) >= 16  # new: generated
    assert "gone" not in passwords  # a user no longer named has no password
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Run again (a restarted airflow-init): the generated password stays.
    assert write_passwords(path, env) == ["admin", "bob", "carol"]
    assert json.loads(path.read_text()) == passwords


def test_write_passwords_generates_a_different_password_per_user(tmp_path: Path) -> None:
    path = tmp_path / "passwords.json"
    env = {USERS: "admin:admin,bob:viewer,carol:op", "AIRFLOW_ADMIN_PASSWORD": "admin-pw-12345"}
    write_passwords(path, env)
    passwords = json.loads(path.read_text())
    assert len({passwords["bob"], passwords["carol"], passwords["admin"]}) == 3
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["passwords.json"]  # no temporary left


def test_write_passwords_needs_a_user(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="names no user"):
        write_passwords(tmp_path / "p.json", {USERS: " , ", "AIRFLOW_ADMIN_PASSWORD": "x" * 12})
    assert not (tmp_path / "p.json").exists()


def test_stack_passwords_command_writes_the_file(
    clean_environ: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_environ.setenv(USERS, "admin:admin,viewer:viewer")
    clean_environ.setenv("AIRFLOW_ADMIN_PASSWORD", "admin-pw-12345")
    path = tmp_path / "auth" / "passwords.json"
    result = CliRunner().invoke(app, ["stack-passwords", str(path)])
    assert result.exit_code == 0, result.output
    assert "admin, viewer" in result.output
    passwords = json.loads(path.read_text())
    assert passwords["admin"] == "admin-pw-12345" and passwords["viewer"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_stack_env_keeps_an_existing_file_unless_forced(tmp_path: Path) -> None:
    out = tmp_path / ".env"
    out.write_text("AIRFLOW_FERNET_KEY=mine\n")
    kept = run_stack_env("--out", str(out))
    assert "kept" in kept.stdout
    assert out.read_text() == "AIRFLOW_FERNET_KEY=mine\n"
    run_stack_env("--out", str(out), "--force")
    env = read_dotenv(out)
    assert env["AIRFLOW_FERNET_KEY"] not in ("", "mine")
    assert all(env[name] for name in SECRETS)


def test_stack_env_applies_overrides(tmp_path: Path) -> None:
    out = tmp_path / ".env"
    run_stack_env(
        "--out",
        str(out),
        "BURSTCV_COMPUTE_BACKEND=ec2",
        "AIRFLOW_JWT_SECRET=" + "s" * 40,
        "AIRFLOW_UID=1000",
        'AIRFLOW_CONN_AWS_DEFAULT={"conn_type": "aws", "extra": {"a": "b=c"}}',
    )
    env = read_dotenv(out)
    assert env["BURSTCV_COMPUTE_BACKEND"] == "ec2"
    assert env["AIRFLOW_JWT_SECRET"] == "s" * 40  # an override beats generation
    assert env["AIRFLOW_UID"] == "1000"
    # A name .env.example only shows commented out is added, its value kept whole.
    assert env["AIRFLOW_CONN_AWS_DEFAULT"] == '{"conn_type": "aws", "extra": {"a": "b=c"}}'
    assert all(env[name] for name in SECRETS)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_stack_env_writes_every_example_setting_and_fresh_secrets(tmp_path: Path) -> None:
    first, second = tmp_path / "first.env", tmp_path / "second.env"
    run_stack_env("--out", str(first))
    run_stack_env("--out", str(second))
    a, b = read_dotenv(first), read_dotenv(second)
    example = read_dotenv(REPO / ".env.example")
    assert set(a) == set(example) == set(b)
    for name, value in example.items():
        if name not in SECRETS:
            assert a[name] == value == b[name], name
    for name in SECRETS:
        assert example[name] == "", f".env.example must leave {name} for stack-env to generate"
        assert a[name] and b[name] and a[name] != b[name], name
    assert len(base64.urlsafe_b64decode(a["AIRFLOW_FERNET_KEY"])) == 32
    # The secrets stack-env generates are exactly the ones compose requires.
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", COMPOSE.read_text()))
    assert required == set(SECRETS)
