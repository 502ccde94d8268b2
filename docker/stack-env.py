#!/usr/bin/env python3
"""Write the compose stack's .env from .env.example, with a fresh value for every secret.

    python3 docker/stack-env.py [--out .env] [--force] [NAME=VALUE ...]

Secrets left empty in .env.example (the Fernet key, the JWT secret, the admin password, the
PostgreSQL password, the service's admin token) are generated; NAME=VALUE arguments set or
override any line. An existing .env is kept unless --force. Standard library only: it runs
before anything is installed.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GENERATED = {
    "AIRFLOW_FERNET_KEY": lambda: base64.urlsafe_b64encode(os.urandom(32)).decode(),
    "AIRFLOW_JWT_SECRET": lambda: secrets.token_urlsafe(48),
    "AIRFLOW_ADMIN_PASSWORD": lambda: secrets.token_urlsafe(18),
    "POSTGRES_PASSWORD": lambda: secrets.token_urlsafe(24),
    "BURSTCV_SERVING_ADMIN_TOKEN": lambda: secrets.token_urlsafe(32),
}


def render(example: str, overrides: dict[str, str]) -> str:
    lines, seen = [], set()
    for line in example.splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            seen.add(name)
            if name in overrides:
                value = overrides[name]
            elif not value and name in GENERATED:
                value = GENERATED[name]()
            line = f"{name}={value}"
        lines.append(line)
    lines += [f"{k}={v}" for k, v in overrides.items() if k not in seen]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".env")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    parser.add_argument("set", nargs="*", metavar="NAME=VALUE")
    args = parser.parse_args()
    if args.out.exists() and not args.force:
        print(f"{args.out} exists; kept (--force replaces it)")  # noqa: T201
        return 0
    if bad := [item for item in args.set if "=" not in item]:
        parser.error(f"not NAME=VALUE: {' '.join(bad)}")
    overrides = dict(item.split("=", 1) for item in args.set)
    text = render((REPO / ".env.example").read_text(), overrides)
    args.out.touch(mode=0o600)
    args.out.chmod(0o600)  # an existing file keeps its mode through touch
    args.out.write_text(text)
    print(f"wrote {args.out} with fresh secrets")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
