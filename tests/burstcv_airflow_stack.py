"""Start a real, distributed Airflow from this checkout for tests: one process per component.

:func:`airflow_stack` creates a fresh PostgreSQL database (and, for the CeleryExecutor, claims an
empty Redis database number), migrates it, and starts ``airflow scheduler``, ``dag-processor``,
``triggerer``, ``api-server`` and ``celery worker`` as separate process groups bound to
127.0.0.1 on free ports, each logging to its own file. On exit, whatever happened, it stops
every process group, drops the database and flushes the Redis database it claimed. This is the
production topology of docker-compose.yaml without Docker: the components talk only through
the metadata database, the broker and the api-server's execution API.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from burstcv_testkit import init_airflow_db
from localserver import free_port, start_process_group, stop_process_groups

# tests/burstcv_airflow_stack.py -> the checkout whose dags/, plugins/, src/ and serving/ the
# stack runs (tests always run from a checkout, whatever burstcv the venv has installed).
REPO_ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

CELERY_COMPONENTS = ("dag-processor", "scheduler", "triggerer", "api-server", "celery-worker")
LOCAL_COMPONENTS = ("dag-processor", "scheduler", "api-server")
# Health keys of GET /api/v2/monitor/health for components that heartbeat into the database.
HEALTH_KEYS = {"scheduler": "scheduler", "triggerer": "triggerer", "dag-processor": "dag_processor"}
STOP_GRACE_S = 20.0


class StackError(RuntimeError):
    """Raise when the stack cannot start; the message carries the failing component's log."""


@dataclass(frozen=True)
class PostgresServer:
    """Name a PostgreSQL server the stack may create databases on (trust or password auth)."""

    host: str = "127.0.0.1"
    port: int = 5432
    user: str = "postgres"
    password: str = ""

    def url(self, database: str, driver: str = "postgresql+psycopg2") -> str:
        """Return a SQLAlchemy URL for one database on this server."""
        auth = f"{self.user}:{self.password}" if self.password else self.user
        return f"{driver}://{auth}@{self.host}:{self.port}/{database}"

    def _admin(self, statement: str) -> None:
        """Run one statement on the server's ``postgres`` database, outside a transaction."""
        import psycopg2

        conn = psycopg2.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password or None,
            dbname="postgres",
        )
        conn.autocommit = True  # CREATE/DROP DATABASE cannot run inside a transaction
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
        finally:
            conn.close()

    @contextlib.contextmanager
    def temporary_database(self, prefix: str = "burstcv_test_") -> Iterator[str]:
        """Create a uniquely named database; drop it (closing its connections) on exit."""
        name = f"{prefix}{secrets.token_hex(6)}"
        self._admin(f'CREATE DATABASE "{name}"')
        log.info("created database %s", name)
        try:
            yield name
        finally:
            self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            log.info("dropped database %s", name)


@dataclass(frozen=True)
class RedisServer:
    """Name a Redis server whose numbered databases the stack may claim one of."""

    host: str = "127.0.0.1"
    port: int = 6379
    databases: int = 16

    @contextlib.contextmanager
    def claimed_database(self) -> Iterator[int]:
        """Claim an empty database number (not 0) for this stack; flush it on exit."""
        import redis

        claim_key = "burstcv:stack-claim"
        token = secrets.token_hex(8)
        numbers = list(range(1, self.databases))
        random.shuffle(numbers)
        for number in numbers:
            client = redis.Redis(host=self.host, port=self.port, db=number)
            # Empty, then claimed atomically: two stacks starting together never share one.
            if client.dbsize() == 0 and client.set(claim_key, token, nx=True):
                break
            client.close()
        else:
            raise StackError(f"no empty Redis database on {self.host}:{self.port}")
        log.info("claimed redis db %d", number)
        try:
            yield number
        finally:
            client.flushdb()
            client.close()

    def url(self, number: int) -> str:
        """Return a Celery broker URL for one database number."""
        return f"redis://{self.host}:{self.port}/{number}"


@dataclass
class AirflowStack:
    """Describe a running stack: where it listens, its environment, its processes and logs."""

    home: Path
    api_url: str
    env: dict[str, str]
    database: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def log_dir(self) -> Path:
        """Return the folder with one log file per component."""
        return self.home / "component-logs"

    def log_tail(self, component: str, chars: int = 3000) -> str:
        """Return the end of a component's log."""
        path = self.log_dir / f"{component}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def all_log_tails(self, chars: int = 1500) -> str:
        """Return the end of every component's log, for a failure message."""
        return "\n".join(
            f"----- {name} -----\n{self.log_tail(name, chars)}" for name in self.processes
        )

    def token(self) -> str:
        """Return a JWT for the REST API (the simple auth manager, every user an admin)."""
        response = httpx.get(f"{self.api_url}/auth/token", timeout=30)
        response.raise_for_status()
        return str(response.json()["access_token"])

    def client(self, timeout_s: float = 60.0) -> httpx.Client:
        """Return an HTTP client for the api-server that sends the admin JWT."""
        return httpx.Client(
            base_url=self.api_url,
            headers={"Authorization": f"Bearer {self.token()}"},
            timeout=timeout_s,
        )

    def assert_running(self) -> None:
        """Raise StackError naming any component process that has exited."""
        dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
        if dead:
            raise StackError(f"components exited: {dead}\n{self.all_log_tails()}")


def _component_command(component: str, api_port: int, concurrency: int = 2) -> list[str]:
    airflow = [sys.executable, "-m", "airflow"]
    commands = {
        # --skip-serve-logs: Airflow's log server binds every interface; the components share
        # one AIRFLOW_HOME here, so the api-server reads task and trigger logs from disk.
        "scheduler": [*airflow, "scheduler", "--skip-serve-logs"],
        "dag-processor": [*airflow, "dag-processor"],
        "triggerer": [*airflow, "triggerer", "--skip-serve-logs"],
        "api-server": [
            *airflow,
            "api-server",
            "--host",
            "127.0.0.1",
            "--port",
            str(api_port),
            "--workers",
            "1",
        ],
        # Two task slots by default: the machine running the tests has few cores.
        "celery-worker": [
            *airflow,
            "celery",
            "worker",
            "--concurrency",
            str(concurrency),
            "--skip-serve-logs",
        ],
    }
    if component.startswith("celery-worker-"):  # a further worker: celery-worker-2, ...
        # Its own Celery node name: two workers of one name on a broker would clash.
        return [*commands["celery-worker"], "--celery-hostname", f"{component}@%h"]
    if component not in commands:
        raise ValueError(f"unknown component {component!r}; choose {', '.join(commands)}")
    return commands[component]


def stack_env(
    home: Path,
    *,
    executor: str,
    sql_alchemy_conn: str,
    api_port: int,
    broker_url: str | None = None,
    result_backend: str | None = None,
) -> dict[str, str]:
    """Return the Airflow environment shared by every component of one stack."""
    env = {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": executor,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql_alchemy_conn,
        # Workers reach the api-server's execution API to run tasks; all must share one secret.
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{api_port}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        # Free ports even for servers not started (logs are not served, the health check is
        # off): another stack on this machine must never collide with this one.
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        # Fast feedback: pick up DAG files and queued work quickly.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "600",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        "PYTHONUNBUFFERED": "1",
        # Absolute, so components find burstcv whatever their working directory (an editable
        # install makes this redundant; a PYTHONPATH=src checkout needs it).
        "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT / "src"), str(REPO_ROOT / "serving")]
            + [
                str(Path(p).resolve())
                for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p
            ]
        ),
    }
    if broker_url:
        env["AIRFLOW__CELERY__BROKER_URL"] = broker_url
    if result_backend:
        env["AIRFLOW__CELERY__RESULT_BACKEND"] = result_backend
    return env


def burstcv_env(store: Path, dataset: Path, *, serving_url: str = "") -> dict[str, str]:
    """Return the BURSTCV_* settings of a stack whose runs keep everything under ``store``.

    ``serving_url`` empty: deploys move the registry's aliases only. No cron schedule: a
    scheduled run would hold the DAG's single active-run slot (max_active_runs=1) and keep
    the run a test triggers from starting.
    """
    return {
        "BURSTCV_ARTIFACT_ROOT": str(store / "artifacts"),
        "BURSTCV_REGISTRY_URI": str(store / "registry"),
        "BURSTCV_COMPUTE_STATE_DIR": str(store / "compute"),
        "BURSTCV_DATASET_URI": str(dataset),
        "BURSTCV_SERVING_URL": serving_url,
        "BURSTCV_SCHEDULE": "",
    }


def end_every_box(store: Path) -> None:
    """Terminate every local box recorded under ``store/compute`` (a failed run's included)."""
    from burstcv.compute.local import LocalBackend

    backend = LocalBackend(str(store / "compute"))
    for run_dir in (store / "compute").glob("*"):
        if run_dir.is_dir():
            backend.terminate_run(run_dir.name)


def _start(
    component: str,
    api_port: int,
    env: dict[str, str],
    log_dir: Path,
    concurrency: int = 2,
    *,
    pin: bool = False,
) -> subprocess.Popen[bytes]:
    command = _component_command(component, api_port, concurrency)
    if pin and component.startswith("celery-worker"):
        number = int(component.rsplit("-", 1)[1]) if component[-1].isdigit() else 1
        command = ["taskset", "--cpu-list", str((number - 1) % (os.cpu_count() or 1)), *command]
    return start_process_group(
        command,
        log_path=log_dir / f"{component}.log",
        env=env,
        cwd=env["AIRFLOW_HOME"],
    )


def _wait_ready(stack: AirflowStack, components: Sequence[str], timeout_s: float) -> None:
    """Wait until the api-server answers and every heartbeating component reports healthy."""
    wanted = [HEALTH_KEYS[c] for c in components if c in HEALTH_KEYS]
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        stack.assert_running()
        try:
            health = httpx.get(f"{stack.api_url}/api/v2/monitor/health", timeout=5).json()
        except (httpx.HTTPError, ValueError) as exc:
            last = repr(exc)
        else:
            states = {key: (health.get(key) or {}).get("status") for key in wanted}
            worker_ready = all(
                " ready." in stack.log_tail(c, 200_000)
                for c in components
                if c.startswith("celery-worker")
            )
            if all(s == "healthy" for s in states.values()) and worker_ready:
                return
            last = f"health {states}, celery worker ready: {worker_ready}"
        time.sleep(2)
    raise StackError(f"stack not ready after {timeout_s:.0f} s ({last})\n{stack.all_log_tails()}")


@contextlib.contextmanager
def airflow_stack(
    extra_env: dict[str, str] | None = None,
    *,
    executor: str = "CeleryExecutor",
    components: Sequence[str] | None = None,
    postgres: PostgresServer | None = None,
    redis_server: RedisServer | None = None,
    home: Path | None = None,
    startup_timeout_s: float = 300.0,
    celery_workers: int = 1,
    worker_concurrency: int = 2,
    pin_workers: bool = False,
) -> Iterator[AirflowStack]:
    """Run Airflow as separate processes on a fresh PostgreSQL database; stop it all on exit.

    ``executor`` is ``CeleryExecutor`` (Redis broker, ``celery_workers`` Celery workers,
    named ``celery-worker``, ``celery-worker-2``, ..., with ``worker_concurrency`` task slots
    each (``pin_workers``: worker n on CPU n-1 alone, as if each were a machine of its own),
    a triggerer) or ``LocalExecutor`` (the
    scheduler runs tasks itself; no broker). ``extra_env`` (the ``BURSTCV_*`` settings of the
    run, typically) reaches every component.
    """
    import tempfile

    celery = executor == "CeleryExecutor"
    more_workers = tuple(f"celery-worker-{n}" for n in range(2, celery_workers + 1))
    components = tuple(
        components or ((*CELERY_COMPONENTS, *more_workers) if celery else LOCAL_COMPONENTS)
    )
    postgres = postgres or PostgresServer()
    redis_server = redis_server or RedisServer()
    with contextlib.ExitStack() as cleanup:
        if home is None:
            home = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="airflow-stack-")))
        database = cleanup.enter_context(postgres.temporary_database())
        broker = result_backend = None
        if celery:
            broker = redis_server.url(cleanup.enter_context(redis_server.claimed_database()))
            result_backend = postgres.url(database, driver="db+postgresql+psycopg2")
        api_port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
            **stack_env(
                home,
                executor=executor,
                sql_alchemy_conn=postgres.url(database),
                api_port=api_port,
                broker_url=broker,
                result_backend=result_backend,
            ),
            **(extra_env or {}),
        }
        stack = AirflowStack(
            home=home, api_url=f"http://127.0.0.1:{api_port}", env=env, database=database
        )
        stack.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        try:
            init_airflow_db(env, cwd=home)
        except RuntimeError as exc:
            raise StackError(str(exc)) from None
        log.info("migrated %s in %.1f s", database, time.monotonic() - started)
        cleanup.callback(stop_process_groups, stack.processes.values(), STOP_GRACE_S)
        for component in components:
            stack.processes[component] = _start(
                component, api_port, env, stack.log_dir, worker_concurrency, pin=pin_workers
            )
        _wait_ready(stack, components, startup_timeout_s)
        log.info(
            "airflow stack (%s) up at %s in %.1f s",
            ", ".join(components),
            stack.api_url,
            time.monotonic() - started,
        )
        yield stack
