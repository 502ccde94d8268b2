"""Stand up a sandbox that looks like a fresh EC2 instance, and boot a real user-data script in it.

A network namespace made for the test holds the "box": 169.254.169.254 answers there as the
instance metadata service (IMDSv2 tokens, instance id and type, region, role credentials and
a spot instance-action the test switches on), and 127.0.0.1:5000 there relays to the moto
server outside, which plays S3. The user-data runs unmodified with ``bash`` under
``ip netns exec``; only ``shutdown`` and ``poweroff`` are shims (they record the call; the
harness then terminates the emulated instance, as InstanceInitiatedShutdownBehavior says).
curl, pip and the training code are the real ones. The box runs as on its image (``image``):
this machine's Pythons are hidden from its PATH; its ``python3`` has no boto3 (Amazon Linux
2023's has none, nor has the Deep Learning AMI's system Python); on Amazon Linux 2023 an AWS
CLI v2 stand-in answers ``aws`` (boto3 in an interpreter the box cannot import, with v2's
documented exit codes) and ``dnf install python3.11`` makes a fresh Python 3.11 with pip. The
Deep Learning AMI's PyTorch environment is a venv that sees this environment's torch,
torchvision, numpy and boto3 (and what they need), nothing else. The namespace has no route
but to the emulator: a pip that needs the package index fails there.

Sockets are made inside the namespace by a short-lived thread that enters it with setns(2):
the servers themselves run in the test process, and nothing listens outside 127.0.0.1.

Several boxes of one run (``link``): a virtual ethernet pair joins two sandboxes on a private
subnet, each box's metadata answers its own private address and launch index, and each
namespace's /etc/hosts (``ip netns exec`` mounts /etc/netns/<name>/hosts) resolves the
machine's hostname to the box's own address, as an EC2 instance's does. A boot can mount a
folder of its own over a path (``mounts``): two boxes that each install into "the AMI's"
Python get one each, as two instances have two disks.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
IMDS_ADDRESS = "169.254.169.254"
S3_PORT_IN_BOX = 5000
ROLE_NAME = "burstcv-training"


class SandboxUnavailable(RuntimeError):
    """Raise when this machine does not allow network namespaces (not root, no iproute2)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        raise SandboxUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")


def socket_in_netns(netns: str, host: str, port: int) -> socket.socket:
    """Return a listening TCP socket bound inside the namespace (setns on a throwaway thread)."""
    made: dict[str, Any] = {}

    def enter_and_bind() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns failed")
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            made["sock"] = sock
        except OSError as exc:
            made["error"] = exc

    # The thread ends with the namespace switch; the socket stays in the namespace.
    worker = threading.Thread(target=enter_and_bind)
    worker.start()
    worker.join()
    if "error" in made:
        raise SandboxUnavailable(f"cannot bind {host}:{port} in {netns}: {made['error']}")
    return made["sock"]  # type: ignore[no-any-return]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, sock: socket.socket, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(sock.getsockname(), handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock


@dataclass
class Imds:
    """Hold what the fake instance metadata service answers, and what it was asked."""

    instance_id: str = "i-0000000000sandbox"
    instance_type: str = "g6.xlarge"
    region: str = "us-east-1"
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    spot_action: dict[str, str] | None = None
    ami_launch_index: int = 0  # its place in its RunInstances call: a node rank
    local_ipv4: str = ""  # its private address ("" when the box has no link)
    credentials_delay_s: float = 0.0  # how slowly the role's credentials come, as on a busy box
    requests: list[tuple[str, str, bool]] = field(default_factory=list)  # method, path, token?

    def answer(self, method: str, path: str, token: str | None) -> tuple[int, str]:
        """Return (status, body) as IMDSv2 would (a GET without a valid token is 401)."""
        self.requests.append((method, path, token == self.token))
        if method == "PUT":
            return (200, self.token) if path == "/latest/api/token" else (405, "")
        if token != self.token:
            return 401, ""
        meta = path.removeprefix("/latest/meta-data/")
        now = datetime.now(UTC)
        values = {
            "instance-id": self.instance_id,
            "instance-type": self.instance_type,
            "placement/region": self.region,
            "ami-launch-index": str(self.ami_launch_index),
            "iam/security-credentials/": ROLE_NAME,
            f"iam/security-credentials/{ROLE_NAME}": json.dumps(
                {
                    "Code": "Success",
                    "LastUpdated": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "Type": "AWS-HMAC",
                    "AccessKeyId": "ASIASANDBOXROLE",
                    "SecretAccessKey": "sandbox-secret",
                    "Token": "sandbox-session-token",
                    "Expiration": (now + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
            ),
        }
        if self.local_ipv4:
            values["local-ipv4"] = self.local_ipv4
        if meta == "spot/instance-action":
            return (200, json.dumps(self.spot_action)) if self.spot_action else (404, "")
        if meta in values:
            if meta.startswith("iam/security-credentials/") and self.credentials_delay_s:
                time.sleep(self.credentials_delay_s)
            return 200, values[meta]
        return 404, ""


def _imds_handler(imds: Imds) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            status, body = imds.answer(
                self.command, self.path, self.headers.get("X-aws-ec2-metadata-token")
            )
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = _reply
        do_PUT = _reply

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler


def _relay(listener: socket.socket, upstream: tuple[str, int], stop: threading.Event) -> None:
    """Accept connections in the namespace and pipe each to ``upstream`` outside it."""
    try:
        listener.settimeout(0.2)
    except OSError:  # closed before it started (cut_s3)
        return
    while not stop.is_set():
        try:
            inner, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=_pipe, args=(inner, upstream), daemon=True).start()


def _pipe(inner: socket.socket, upstream: tuple[str, int]) -> None:
    try:
        outer = socket.create_connection(upstream, timeout=30)
    except OSError:
        inner.close()
        return
    sel = selectors.DefaultSelector()
    sel.register(inner, selectors.EVENT_READ, outer)
    sel.register(outer, selectors.EVENT_READ, inner)
    try:
        while True:
            for key, _ in sel.select(timeout=60):
                src: socket.socket = key.fileobj  # type: ignore[assignment]
                data = src.recv(65536)
                if not data:
                    return
                key.data.sendall(data)
    except OSError:
        return
    finally:
        sel.close()
        inner.close()
        outer.close()


# What the Deep Learning AMI's PyTorch environment holds of what burstcv's boxes import.
DLAMI_PACKAGES = ("torch", "torchvision", "numpy", "boto3")
_HIDDEN = re.compile(r"(python|pip|pydoc|idle|2to3|aws|dnf)")  # not on a box's PATH


def make_ami_python(where: Path, packages: tuple[str, ...] = DLAMI_PACKAGES) -> Path:
    """Return a Python standing in for the AMI's PyTorch environment: it sees ``packages`` of
    this environment and what they require, nothing else (its path names its version)."""
    python = where / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if python.exists():
        return python
    subprocess.run([_base_python(), "-m", "venv", str(where)], check=True, timeout=300)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shelf = where / "ami-packages"
    shelf.mkdir()
    for dist in _closure(packages):
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops - {"__pycache__", "bin"}:
            with contextlib.suppress(FileExistsError):
                (shelf / top).symlink_to(Path(str(dist.locate_file(top))))
    Path(site, "ami_pytorch_env.pth").write_text(f"{shelf}\n")
    return python


def _closure(names: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """Return the distributions ``names`` need (their requirements, transitively, no extras)."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in found[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def make_bare_python(where: Path, pip: bool = False) -> Path:
    """Return a Python of this version with nothing installed (no boto3), with pip or not."""
    python = where / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    if not python.exists():
        command = [_base_python(), "-m", "venv", *([] if pip else ["--without-pip"]), str(where)]
        subprocess.run(command, check=True, timeout=300)
    return python


def _base_python() -> str:
    return getattr(sys, "_base_executable", sys.executable)


# The AWS CLI v2 subcommands the boot scripts use, with the exit codes v2 documents: 0; 1 an
# s3 transfer failed; 2 a local file skipped; 252 a command it cannot parse; 253 no
# credentials or region; 254 the service answered an error; 255 no answer (and the rest).
AWS_CLI_V2 = """#!{python}
import json, sys
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, NoRegionError
from botocore.exceptions import PartialCredentialsError


def client():
    config = Config(connect_timeout=60, retries={{"mode": "standard", "max_attempts": 3}})
    return boto3.client("s3", config=config)


def split(uri):
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def head_object(args):
    options = dict(zip(args[::2], args[1::2]))
    if len(args) != 4 or set(options) != {{"--bucket", "--key"}}:
        return usage()
    try:
        answer = client().head_object(Bucket=options["--bucket"], Key=options["--key"])
    except ClientError as exc:
        error = exc.response.get("Error", {{}})
        print(f"\\nAn error occurred ({{error.get('Code')}}) when calling the HeadObject "
              f"operation: {{error.get('Message', '')}}", file=sys.stderr)
        return 254
    print(json.dumps({{"ContentLength": answer["ContentLength"]}}))
    return 0


def cp(args):
    args = [arg for arg in args if arg != "--quiet"]
    if len(args) != 2 or args[0] == args[1] == "-":
        return usage()
    source, target = args
    try:
        if source.startswith("s3://") and target.startswith("s3://"):
            return usage()
        if source.startswith("s3://"):
            client().download_file(*split(source), target)
        elif source == "-":
            bucket, key = split(target)
            client().put_object(Body=sys.stdin.buffer.read(), Bucket=bucket, Key=key)
        else:
            with open(source, "rb") as data:
                client().upload_fileobj(data, *split(target))
    except FileNotFoundError:
        print(f"warning: Skipping file {{source}}. File does not exist.", file=sys.stderr)
        return 2
    except (NoCredentialsError, NoRegionError, PartialCredentialsError):
        raise
    except (ClientError, BotoCoreError) as exc:
        print(f"fatal error: {{exc}}", file=sys.stderr)
        return 1
    return 0


def usage():
    print("aws: error: the following arguments are not understood: " + " ".join(sys.argv[1:]),
          file=sys.stderr)
    return 252


def main(argv):
    if argv[:2] == ["s3api", "head-object"]:
        return head_object(argv[2:])
    if argv[:2] == ["s3", "cp"]:
        return cp(argv[2:])
    return usage()


try:
    sys.exit(main(sys.argv[1:]))
except (NoCredentialsError, NoRegionError, PartialCredentialsError) as exc:
    print(exc, file=sys.stderr)
    sys.exit(253)
except Exception as exc:
    print(f"\\n{{exc}}", file=sys.stderr)
    sys.exit(255)
"""

# Amazon Linux 2023's dnf, as far as the sizing boxes use it: python3.X and its pip.
DNF = """#!/bin/bash
for name in "$@"; do
  case "$name" in
    install | -y | -q | {python} | {python}-pip) ;;
    *) echo "Error: Unable to find a match: $name" >&2; exit 1 ;;
  esac
done
[ -x {installed}/bin/{python} ] || {base} -m venv {installed}
"""


@dataclass
class Boot:
    """Record one boot of a user-data script in the sandbox."""

    exit_code: int
    seconds: float
    console: str
    shutdown_calls: list[list[str]]
    box_dir: Path

    @property
    def powered_off(self) -> bool:
        """Return True if the script ran ``shutdown -h now`` (or poweroff)."""
        return any("now" in call or call[:1] == ["poweroff"] for call in self.shutdown_calls)


class BoxSandbox:
    """A network namespace dressed as an EC2 instance; boot user-data scripts in it."""

    def __init__(self, work: Path, s3_upstream: str, image: str = "dlami") -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise SandboxUnavailable("network namespaces need root and iproute2")
        if image not in ("dlami", "al2023"):
            raise ValueError(f"image is dlami or al2023, not {image!r}")
        self.work = work
        self.image = image
        self.netns = f"burstcv-box-{uuid.uuid4().hex[:8]}"
        self.imds = Imds()
        host, _, port = s3_upstream.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self._stop = threading.Event()
        self._servers: list[_Server] = []
        self._threads: list[threading.Thread] = []
        self.shims = work / "shims"
        self.system = work / "image"  # the image's own commands: python3, aws, dnf
        self.installed = work / "installed"  # where dnf puts its Python (and pip, its scripts)
        self.usr_bin = work / "usr-bin"  # this machine's /usr/bin, less its Pythons and CLIs
        # cloud-init's PATH on the box: no AWS CLI on the Deep Learning AMI until add_aws_cli.
        self.path = ":".join(
            map(str, [self.shims, self.system, self.installed / "bin", "/usr/local/sbin"])
        )
        self.path += f":/usr/local/bin:/usr/sbin:{self.usr_bin}"

    def __enter__(self) -> BoxSandbox:
        _ip("netns", "add", self.netns)
        try:
            _ip("-n", self.netns, "link", "set", "lo", "up")
            _ip("-n", self.netns, "addr", "add", f"{IMDS_ADDRESS}/32", "dev", "lo")
            imds_server = _Server(
                socket_in_netns(self.netns, IMDS_ADDRESS, 80), _imds_handler(self.imds)
            )
            self._servers.append(imds_server)
            self._spawn(imds_server.serve_forever)
            relay_sock = socket_in_netns(self.netns, "127.0.0.1", S3_PORT_IN_BOX)
            self._relay_sock = relay_sock
            self._spawn(_relay, relay_sock, self._upstream, self._stop)
            self._write_shims()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _write_shims(self) -> None:
        self.shims.mkdir(parents=True, exist_ok=True)
        # The only stand-ins: power control. Everything else the script runs is real.
        shim = self.shims / "shutdown"
        shim.write_text(
            '#!/bin/bash\necho "$(basename "$0") $*" >> "$SANDBOX_SHUTDOWN_LOG"\nexit 0\n'
        )
        shim.chmod(0o755)
        (self.shims / "poweroff").symlink_to(shim)
        self.usr_bin.mkdir(parents=True, exist_ok=True)
        for command in Path("/usr/bin").iterdir():
            if not _HIDDEN.match(command.name):
                (self.usr_bin / command.name).symlink_to(command)
        self.system.mkdir(parents=True, exist_ok=True)
        python3 = make_bare_python(self.work / "system-python")
        _script(self.system / "python3", f'#!/bin/bash\nexec {python3} "$@"\n')
        if self.image == "al2023":
            self._write_aws_cli(self.system / "aws")
            version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
            dnf = DNF.format(python=version, installed=self.installed, base=_base_python())
            _script(self.system / "dnf", dnf)

    def _write_aws_cli(self, where: Path) -> None:
        _script(where, AWS_CLI_V2.format(python=sys.executable))

    def routes(self) -> str:
        """Return the namespace's routes (IPv4 and IPv6), as ``ip route`` prints them."""
        return "".join(
            subprocess.run(
                ["ip", *family, "-n", self.netns, "route"], capture_output=True, text=True
            ).stdout
            for family in ([], ["-6"])
        )

    def cut_s3(self) -> None:
        """Let nothing out of the box to S3, as a security group with no egress rule does.

        The relay stops listening: a connection to S3 fails (refused here; an instance whose
        group drops its packets times out, a minute later, the same way).
        """
        with contextlib.suppress(OSError):
            self._relay_sock.close()

    def add_aws_cli(self) -> None:
        """Put the AWS CLI v2 stand-in on the box's PATH (the Deep Learning AMI has one)."""
        self._write_aws_cli(self.shims / "aws")

    def processes(self) -> list[int]:
        """Return the pids still running in the namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=10
        ).stdout
        return [int(pid) for pid in out.split()]

    def boot(
        self,
        user_data: str,
        *,
        timeout_s: float = 480.0,
        mounts: dict[Path, Path] | None = None,
        threads: int | None = None,
        cpus: list[int] | None = None,
    ) -> Boot:
        """Run the user-data as cloud-init would (root, clean environment) and wait for it.

        ``timeout_s`` only stops a hung boot: a CPU epoch of the demo slice takes 5 s on a quiet
        2-core machine and 40 s on a busy one, so it is generous, and no test measures time by it.
        ``mounts`` ({path on the box: folder of this box}) are seen by this boot alone.
        ``threads`` caps the box's compute threads (OMP_NUM_THREADS): boxes booted side by side
        share this machine's cores, where instances would each have their own.
        ``cpus`` gives the box those CPUs alone (CPU affinity): what "its vCPUs" are to a box
        that measures on them.
        """
        box = self.work / f"boot-{uuid.uuid4().hex[:6]}"
        (box / "home").mkdir(parents=True)
        script = box / "user-data.sh"
        script.write_text(user_data)
        env = {
            "PATH": self.path,
            "HOME": str(box / "home"),
            "LANG": "C.UTF-8",
            # Where "S3" is inside the sandbox; on EC2 the CLI and boto3 find it themselves.
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT_IN_BOX}",
            "BURSTCV_WORK_DIR": str(box / "opt"),
            "BURSTCV_LOG": str(box / "bootstrap.log"),
            "SANDBOX_SHUTDOWN_LOG": str(box / "shutdown.log"),
            # An image has no pip configuration (this machine's names local package mirrors).
            "PIP_CONFIG_FILE": os.devnull,
        }
        shutil.rmtree(self.installed, ignore_errors=True)  # a fresh box: nothing installed yet
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        started = time.monotonic()
        with open(box / "console.log", "wb") as console:
            command = ["ip", "netns", "exec", self.netns, "bash", str(script)]
            if cpus is not None:
                command = ["taskset", "-c", ",".join(map(str, cpus)), *command]
            if mounts:
                binds = " && ".join(
                    f"mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}"
                    for dst, src in mounts.items()
                )
                prefix = command[: command.index("bash")]
                command = [
                    *prefix,
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "bash",
                    "-c",
                    f"{binds} && exec bash {shlex.quote(str(script))}",
                ]
            proc = subprocess.Popen(
                command,
                env=env,
                stdout=console,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
        seconds = time.monotonic() - started
        calls = []
        log = box / "shutdown.log"
        if log.exists():
            calls = [line.split() for line in log.read_text().splitlines() if line.strip()]
        return Boot(code, seconds, (box / "console.log").read_text(), calls, box)

    def power_loss(self) -> list[int]:
        """Kill every process of the box at once (SIGKILL, no trap runs); return their pids."""
        killed = self.processes()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def reap_processes(self, grace_s: float = 5.0) -> list[int]:
        """Wait for the namespace to empty; kill and return whatever is still there."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self.processes():
            time.sleep(0.1)
        left = self.processes()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left

    def close(self) -> None:
        """Stop the servers, kill what runs in the namespace, and delete it."""
        self._stop.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        with contextlib.suppress(OSError, AttributeError):
            self._relay_sock.close()
        with contextlib.suppress(SandboxUnavailable):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _ip("netns", "del", self.netns)
        shutil.rmtree(Path("/etc/netns") / self.netns, ignore_errors=True)


def link(boxes: list[BoxSandbox], subnet: str = "10.77.0") -> list[str]:
    """Join two sandboxes by a virtual ethernet pair; return their private addresses.

    Box i gets ``<subnet>.<i + 1>``; its metadata answers it as ``local-ipv4``, and its
    /etc/hosts resolves the machine's hostname to it (what gloo binds to by default).
    """
    if len(boxes) != 2:
        raise ValueError("a veth pair joins two boxes")
    suffix = uuid.uuid4().hex[:6]
    ends = [f"bcv{suffix}a", f"bcv{suffix}b"]
    _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
    addresses = []
    for index, (box, end) in enumerate(zip(boxes, ends, strict=True)):
        address = f"{subnet}.{index + 1}"
        _ip("link", "set", end, "netns", box.netns)
        _ip("-n", box.netns, "addr", "add", f"{address}/24", "dev", end)
        _ip("-n", box.netns, "link", "set", end, "up")
        box.imds.local_ipv4 = address
        hosts = Path("/etc/netns") / box.netns / "hosts"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(
            f"127.0.0.1 localhost\n{address} {socket.gethostname()} {socket.getfqdn()}\n"
        )
        addresses.append(address)
    return addresses


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@contextlib.contextmanager
def sandbox(work: Path, s3_upstream: str) -> Iterator[BoxSandbox]:
    """Yield a started sandbox and always remove it."""
    with BoxSandbox(work, s3_upstream) as box:
        yield box
