"""The open-loop load generator, and the trivial endpoint its own ceiling is measured on.

Requests leave when due whatever the answers do, latency counts from when a request was due and
send lag is kept, so a generator that falls behind shows it rather than passing it off as service
latency. Requests are encoded once, written over persistent HTTP/1.1 connections (an httpx client
tops out at a few hundred a second on one CPU). hey and wrk are closed-loop; wrk2 or vegeta would
be one more binary for every sizing box to carry.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

PREDICT_PATH = "/v1/predict"
BOUNDARY = "burstcv-load-5f1e0c"
# A trivial endpoint's answer: about the size of the service's (a label and a few scores).
TRIVIAL_BODY = (
    b'{"label":"trivial","score":1.0,"top_k":[{"label":"trivial","score":1.0}],'
    b'"model_version":0,"latency_ms":0.0}'
)


@dataclass
class Sample:
    """What a stretch of load collected, and the span its requests were sent over."""

    latencies: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    shed: int = 0
    wall_s: float = 0.0
    peak_in_flight: int = 0
    lags: list[float] = field(default_factory=list)

    def add(self, other: Sample) -> None:
        """Append a later stretch (spans add up)."""
        self.latencies += other.latencies
        self.lags += other.lags
        for code, n in other.statuses.items():
            self.statuses[code] = self.statuses.get(code, 0) + n
        self.shed += other.shed
        self.wall_s += other.wall_s
        self.peak_in_flight = max(self.peak_in_flight, other.peak_in_flight)

    def count(self, code: str, shed: bool) -> None:
        self.statuses[code] = self.statuses.get(code, 0) + 1
        self.shed += shed


def parallel(samples: Sequence[Sample]) -> Sample:
    """Merge stretches sent at the same time (one per generator process)."""
    merged = Sample()
    for s in samples:
        merged.add(s)
    merged.wall_s = max((s.wall_s for s in samples), default=0.0)
    merged.peak_in_flight = sum(s.peak_in_flight for s in samples)
    return merged


def encode_predict(host: str, body: bytes, name: str, content_type: str) -> bytes:
    """Return one whole prediction request (a multipart upload of ``body``) as bytes."""
    disposition = f'Content-Disposition: form-data; name="file"; filename="{name}"'
    part = (
        f"--{BOUNDARY}\r\n{disposition}\r\nContent-Type: {content_type}\r\n\r\n".encode()
        + body
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )
    head = (
        f"POST {PREDICT_PATH} HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(part)}\r\n\r\n"
    ).encode()
    return head + part


class _Answer(Exception):
    """The answer could not be read as HTTP/1.1."""


async def _read_answer(reader: asyncio.StreamReader) -> tuple[str, bool, bool]:
    """Read one response; return (status, shed, keep the connection)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise _Answer(lines[0][:80])
    fields = (line.partition(":") for line in lines[1:])
    headers = {name.strip().lower(): value.strip() for name, sep, value in fields if sep}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    else:
        await reader.read()  # the body runs to the end of the connection
        return parts[1], False, False
    keep = headers.get("connection", "").lower() != "close" and parts[0] != "HTTP/1.0"
    shed = parts[1] == "503" and "retry-after" in headers
    return parts[1], shed, keep


class _Connections:
    """Send requests over persistent connections to one host, recording each in ``sample``."""

    def __init__(self, url: str, requests: Sequence[bytes], timeout_s: float) -> None:
        parsed = urlsplit(url)
        self.peer = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.requests, self.timeout_s = requests, timeout_s
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.sample = Sample()
        self.in_flight = 0
        self.last_sent = 0.0

    async def send(self, i: int, due: float) -> None:
        loop = asyncio.get_running_loop()
        sample, sent = self.sample, loop.time()
        self.last_sent = max(self.last_sent, sent)
        sample.lags.append(max(0.0, sent - due) * 1000)
        self.in_flight += 1
        sample.peak_in_flight = max(sample.peak_in_flight, self.in_flight)
        code, shed, conn = "ConnectError", False, None
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = self.idle.pop() if self.idle else await asyncio.open_connection(*self.peer)
                code = "WriteError"
                conn[1].write(self.requests[i % len(self.requests)])
                await conn[1].drain()
                code = "ReadError"
                code, shed, keep = await _read_answer(conn[0])
            if keep:
                self.idle.append(conn)
                conn = None
        except TimeoutError:
            code = "ReadTimeout" if code == "ReadError" else code
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, _Answer):
            pass
        except ValueError:  # an unreadable length
            code = "ProtocolError"
        finally:
            if conn is not None:
                conn[1].close()
        self.in_flight -= 1
        sample.latencies.append((loop.time() - due) * 1000)
        sample.count(code, shed)


def _process_share(
    url: str,
    requests: Sequence[bytes],
    indices: range,
    rate_rps: float,
    timeout_s: float,
    start_wall: float | None,
) -> Sample:
    """Send request ``i % len(requests)`` for each ``i`` of ``indices``, due at ``i / rate``."""

    async def open_loop() -> Sample:
        loop = asyncio.get_running_loop()
        interval = 1.0 / rate_rps
        start = loop.time() + (0.05 if start_wall is None else max(0.0, start_wall - time.time()))
        conns = _Connections(url, requests, timeout_s)
        conns.last_sent = start
        tasks: set[asyncio.Task[None]] = set()
        for i in indices:
            due = start + i * interval
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(conns.send(i, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        for _, writer in conns.idle:
            writer.close()
        sample = conns.sample
        sample.wall_s = max(conns.last_sent - start, interval * (len(indices) - 1)) or interval
        return sample

    return asyncio.run(open_loop())


def _ready() -> int:
    return os.getpid()


@dataclass
class Senders:
    """Generator processes started once and kept for every rate of a search (each rate's
    sending would otherwise start its own: about a second of spawning per rate)."""

    pool: ProcessPoolExecutor
    pids: frozenset[int]

    @property
    def processes(self) -> int:
        return len(self.pids)


@contextlib.contextmanager
def senders(processes: int) -> Iterator[Senders | None]:
    """Start ``processes`` generator processes (None for one: the caller sends); stop them after."""
    if processes <= 1:
        yield None
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=processes, mp_context=context) as pool:
        pids: set[int] = set()
        while len(pids) < processes:  # each worker spawns on demand: ask until all answered
            pids.update(f.result() for f in [pool.submit(_ready) for _ in range(processes)])
        yield Senders(pool, frozenset(pids))


def send(
    url: str,
    images: Sequence[bytes],
    *,
    requests: int,
    rate_rps: float,
    timeout_s: float = 30.0,
    content_type: str = "image/png",
    first: int = 0,
    processes: int = 1,
    pool: Senders | None = None,
) -> Sample:
    """Send ``requests`` predictions to ``url`` at ``rate_rps``, each when due (request ``i``
    carries image ``first + i``), from ``pool`` or ``processes`` started for the call."""
    if rate_rps <= 0:
        raise ValueError(f"rate_rps must be positive, got {rate_rps}")
    if not images:
        raise ValueError("no images to send")
    requests = max(1, requests)
    host = urlsplit(url).netloc
    encoded = [
        encode_predict(host, images[(first + k) % len(images)], f"{first + k}.png", content_type)
        for k in range(min(len(images), requests))
    ]
    started: contextlib.AbstractContextManager[Senders | None] = (
        senders(min(processes, requests)) if pool is None else contextlib.nullcontext(pool)
    )
    with started as sending:
        if sending is None:
            return _process_share(url, encoded, range(requests), rate_rps, timeout_s, None)
        return _send_from(sending, url, encoded, requests, rate_rps, timeout_s)


def _send_from(
    pool: Senders, url: str, wire: Sequence[bytes], n: int, rate: float, timeout_s: float
) -> Sample:
    """Send ``n`` requests from the pool's processes, each its share, from one shared start."""
    shares = min(pool.processes, n)
    start = time.time() + 0.2
    futures = [
        pool.pool.submit(_process_share, url, wire, range(p, n, shares), rate, timeout_s, start)
        for p in range(shares)
    ]
    return parallel([f.result() for f in futures])


class _Trivial(asyncio.Protocol):
    """Answer each request as soon as its body has arrived: nothing is computed."""

    ANSWER = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(TRIVIAL_BODY)}\r\n\r\n".encode()
        + TRIVIAL_BODY
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self.buffer[:end]).lower()
            at = head.find(b"content-length:")
            length = 0
            if at >= 0:
                line_end = head.find(b"\r\n", at)
                length = int(head[at + 15 : line_end if line_end >= 0 else None])
            if len(self.buffer) < end + 4 + length:
                return
            del self.buffer[: end + 4 + length]
            self.transport.write(self.ANSWER)


async def _serve_trivial(port: int) -> None:
    loop = asyncio.get_running_loop()
    async with await loop.create_server(_Trivial, "127.0.0.1", port, backlog=1024) as server:
        await server.serve_forever()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def trivial_endpoint(cpus: Sequence[int] | None = None, timeout_s: float = 20.0) -> Iterator[str]:
    """Run an endpoint that answers every request at once (on ``cpus``); yield its URL."""
    port = free_port()
    proc = start_on(cpus, [sys.executable, "-m", "burstcv.gate.loadgen", str(port)])
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the trivial endpoint exited with code {proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trivial endpoint did not listen within {timeout_s:g}s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def start_on(cpus: Sequence[int] | None, cmd: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``cmd`` on ``cpus`` only, if given (taskset, else the process's CPU affinity)."""
    taskset = cpus is not None and shutil.which("taskset")
    if cpus is not None and taskset:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, **popen)
    if cpus is not None and not taskset:
        try:
            os.sched_setaffinity(proc.pid, set(cpus))
        except BaseException:
            stop(proc)
            raise
    return proc


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop a process this module or the gate started: SIGTERM, then SIGKILL after grace."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":  # python -m burstcv.gate.loadgen PORT: the trivial endpoint
    asyncio.run(_serve_trivial(int(sys.argv[1])))
