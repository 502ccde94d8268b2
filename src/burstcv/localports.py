"""Check who listens on a local port, so `make serve` / `make airflow` never misread a busy one.

Before starting a server, ``free`` stops if anything listens on the port, naming the holder
and the make variable that chooses another port. After starting one, ``ours`` confirms the
listener is the process just started (or a child) and, for the prediction service, that it
serves this checkout's registry. Without psutil (a bare Python before setup) ``free`` only
knocks on the port and cannot name the holder.

    python -m burstcv.localports free 8000 --var SERVE_PORT --what "the prediction service"
    python -m burstcv.localports ours 8000 --pid 1234 --var SERVE_PORT --registry var/registry
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

REGISTRY_ENV = "BURSTCV_SERVING_REGISTRY_URI"  # what the service reads its registry from
HOST = "127.0.0.1"


class PortProblem(RuntimeError):
    """Raise when a port is not what a make target needs; the message says what to do."""


@dataclass(frozen=True)
class Listener:
    """Describe the process listening on a port (pid None: this user cannot see which)."""

    pid: int | None
    command: str = ""
    cwd: str = ""
    registry: str | None = None
    inspected: bool = True  # False: found by knocking, before psutil is installed

    def describe(self) -> str:
        """Return 'pid N (command, in cwd, registry R)' or 'another user's program'."""
        if not self.inspected:
            return "another program (make setup, then run this again, to see which)"
        if self.pid is None:
            return "a program this user cannot inspect"
        details = [self.command or "?"]
        if self.cwd:
            details.append(f"in {self.cwd}")
        if self.registry:
            details.append(f"registry {self.registry}")
        return f"pid {self.pid} ({', '.join(details)})"


def _answers(port: int) -> bool:
    """Return True when something accepts TCP connections on 127.0.0.1:port."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


def listener(port: int) -> Listener | None:
    """Return the process listening on ``port`` (on 127.0.0.1 or all interfaces), or None."""
    try:
        import psutil
    except ImportError:  # a bare Python before setup
        return Listener(None, inspected=False) if _answers(port) else None
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # macOS without root: fall back to knocking on the port
        connections = []
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port:
            continue
        if conn.laddr.ip not in (HOST, "0.0.0.0", "::", "::1", "::ffff:127.0.0.1"):
            continue
        if conn.pid is None:
            return Listener(None)
        return _describe(conn.pid)
    return Listener(None) if _answers(port) else None


def _describe(pid: int) -> Listener:
    import psutil

    try:
        proc = psutil.Process(pid)
        command = " ".join(proc.cmdline()) or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return Listener(pid)
    try:
        cwd = proc.cwd()
        registry = proc.environ().get(REGISTRY_ENV)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        cwd, registry = "", None
    return Listener(pid, command[:200], cwd, registry)


def _other_port(port: int) -> int:
    """Return a nearby port that is free now (a suggestion for the message)."""
    for candidate in range(port + 1, port + 50):
        if listener(candidate) is None:
            return candidate
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _choose_another(port: int, var: str, target: str) -> str:
    return f"stop it, or choose another port: make {target} {var}={_other_port(port)}"


def check_free(port: int, *, var: str, what: str, target: str) -> None:
    """Raise PortProblem naming the holder if anything listens on ``port`` already."""
    found = listener(port)
    if found is not None:
        raise PortProblem(
            f"cannot start {what}: port {port} on {HOST} is already in use by "
            f"{found.describe()}; {_choose_another(port, var, target)}"
        )


def _same_location(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


def check_ours(port: int, *, pid: int, var: str, target: str, registry: str | None = None) -> None:
    """Raise PortProblem unless process ``pid`` (or a child) listens on ``port``.

    With ``registry``, the listener must also read that registry (a service of another
    checkout is not this one's).
    """
    import psutil

    found = listener(port)
    if found is None:
        raise PortProblem(f"nothing listens on port {port} on {HOST}; see the log")
    family = {pid}
    try:
        family |= {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        family = set()
    if found.pid not in family:
        started = f"pid {pid}" + ("" if family else ", which has exited")
        raise PortProblem(
            f"port {port} on {HOST} is answered by {found.describe()}, not by the process "
            f"just started ({started}); {_choose_another(port, var, target)}"
        )
    if registry is not None and not _same_location(found.registry or "", registry):
        raise PortProblem(
            f"the service on port {port} (pid {found.pid}) reads registry "
            f"{found.registry or '(unset)'}, not this checkout's {registry}; "
            f"{_choose_another(port, var, target)}"
        )


def main(argv: list[str] | None = None) -> int:
    """Run ``free`` or ``ours``; print the problem on stderr and return 1 when there is one."""
    parser = argparse.ArgumentParser(prog="python -m burstcv.localports", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("free", "ours"):
        cmd = sub.add_parser(name)
        cmd.add_argument("port", type=int)
        cmd.add_argument("--var", required=True, help="the make variable that sets the port")
        cmd.add_argument("--target", default="serve", help="the make target to suggest")
        if name == "free":
            cmd.add_argument("--what", default="the server")
        else:
            cmd.add_argument("--pid", type=int, required=True)
            cmd.add_argument("--registry", default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "free":
            check_free(args.port, var=args.var, what=args.what, target=args.target)
        else:
            check_ours(
                args.port, pid=args.pid, var=args.var, target=args.target, registry=args.registry
            )
    except PortProblem as exc:
        sys.stderr.write(f">> {exc}\n")  # the make target's one-line answer
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
