"""Check a compose stack's settings before it starts, and write its UI passwords.

airflow-init runs ``burstcv check-stack`` first: a weak secret or incomplete EC2 settings stop
the stack there, every problem named, instead of failing later in a less readable way.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from pathlib import Path

# Airflow signs its API and UI tokens with this secret (HS512): shorter is guessable.
MIN_JWT_SECRET_CHARS = 32
MIN_ADMIN_PASSWORD_CHARS = 12
# Values that .env.example files (ours and others') carry: never a real secret.
PLACEHOLDERS = frozenset({"change-me", "change-me-too", "changeme", "secret", "airflow", "admin"})
FERNET = "AIRFLOW_FERNET_KEY (AIRFLOW__CORE__FERNET_KEY)"  # the .env name, then Airflow's
GENERATE = "generate one with `python3 docker/stack-env.py` (make stack-env)"


def _fernet_problem(key: str) -> str | None:
    """Return why ``key`` is not a Fernet key (32 url-safe base64-encoded bytes), or None."""
    if not key:
        return f"{FERNET} is empty: connections and variables would be stored in clear"
    try:
        raw = base64.urlsafe_b64decode(key.encode())
    except (binascii.Error, ValueError):
        return f"{FERNET} is not url-safe base64"
    if len(raw) != 32:
        return f"{FERNET} decodes to {len(raw)} bytes, not the 32 of a Fernet key"
    return None


def _secret_problem(name: str, value: str, min_chars: int) -> str | None:
    if not value:
        return f"{name} is empty"
    if value.lower() in PLACEHOLDERS:
        return f"{name} is the placeholder {value!r}"
    if len(value) < min_chars:
        return f"{name} is {len(value)} characters long; at least {min_chars} are needed"
    return None


def _admin_token_problem(token: str) -> str | None:
    """The prediction service's own rule (it listens on 0.0.0.0 in the stack)."""
    from burstcv_spec.admin_token import admin_token_problem

    if token.lower().startswith(tuple(PLACEHOLDERS)):
        return f"BURSTCV_SERVING_ADMIN_TOKEN starts with the placeholder {token!r}"
    return admin_token_problem(token, "0.0.0.0", "production")


def stack_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """Return every problem of a stack's settings (empty: it may start)."""
    env = os.environ if environ is None else environ
    problems = [
        _fernet_problem(env.get("AIRFLOW__CORE__FERNET_KEY", "")),
        _secret_problem(
            "AIRFLOW_JWT_SECRET (AIRFLOW__API_AUTH__JWT_SECRET)",
            env.get("AIRFLOW__API_AUTH__JWT_SECRET", ""),
            MIN_JWT_SECRET_CHARS,
        ),
        _admin_token_problem(env.get("BURSTCV_SERVING_ADMIN_TOKEN", "")),
    ]
    if "AIRFLOW_ADMIN_PASSWORD" in env:
        problems.append(
            _secret_problem(
                "AIRFLOW_ADMIN_PASSWORD", env["AIRFLOW_ADMIN_PASSWORD"], MIN_ADMIN_PASSWORD_CHARS
            )
        )
    found = [p for p in problems if p]
    if env.get("BURSTCV_COMPUTE_BACKEND") == "ec2":
        root = env.get("BURSTCV_ARTIFACT_ROOT", "")
        if not root.startswith("s3://"):
            found.append(
                "BURSTCV_COMPUTE_BACKEND=ec2 needs BURSTCV_ARTIFACT_ROOT=s3://bucket/prefix "
                f"(the GPU boxes read and write there); it is {root or 'unset'}"
            )
        if not env.get("BURSTCV_EC2_INSTANCE_PROFILE"):
            found.append(
                "BURSTCV_COMPUTE_BACKEND=ec2 needs BURSTCV_EC2_INSTANCE_PROFILE, the instance "
                "profile the GPU boxes run as (docs/aws.md)"
            )
    return found


def users(spec: str) -> list[str]:
    """Return the user names of a simple-auth-manager users setting ('alice:admin,bob:viewer')."""
    return [item.split(":", 1)[0].strip() for item in spec.split(",") if item.strip()]


def write_passwords(path: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """Write the simple auth manager's passwords file; return the users it names.

    The first user gets ``AIRFLOW_ADMIN_PASSWORD``; any other keeps its password, or gets a
    random one. The file is readable by its owner only.
    """
    import secrets

    env = os.environ if environ is None else environ
    names = users(env.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "admin:admin"))
    if not names:
        raise ValueError("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS names no user")
    old: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    passwords = {name: old.get(name) or secrets.token_urlsafe(16) for name in names}
    if not env.get("AIRFLOW_ADMIN_PASSWORD"):
        raise ValueError("AIRFLOW_ADMIN_PASSWORD is not set: the first user's password")
    passwords[names[0]] = env["AIRFLOW_ADMIN_PASSWORD"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(json.dumps(passwords, indent=2) + "\n")
    tmp.replace(path)
    return names
