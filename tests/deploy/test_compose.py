"""docker-compose.yaml names only things that exist: files, modules, settings, sane ports.

No Docker engine runs here, so the file is checked statically: every build context,
Dockerfile and COPY source points into this repo and into the build context .dockerignore
leaves; each Airflow service builds the image target it needs; state lives in the stack's own
named volumes (never this checkout's var/); every ``BURSTCV_*`` variable is a field of the
Settings class the container's process reads; ports bind 127.0.0.1; every secret is required
and every variable the file reads is documented in .env.example.
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from burstcv.settings import Ec2Settings
from burstcv.settings import Settings as PipelineSettings
from burstcv_serving.settings import Settings as ServingSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERIGNORE = REPO / ".dockerignore"
AIRFLOW_DOCKERFILE = "docker/airflow.Dockerfile"
TRAIN_LOCK = "docker/requirements-train.txt"
RUNTIME_LOCK = "docker/requirements-runtime.txt"
AIRFLOW_SERVICES = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
    "airflow-worker": "celery worker",
    "airflow-bench-worker": "celery worker",
}
INFRA = {"postgres", "redis", "airflow-init", "serving", "moto"}
# Services that run burstcv's Airflow image (airflow-init too), and the image target of each.
AIRFLOW_IMAGE_SERVICES = [*AIRFLOW_SERVICES, "airflow-init"]
WORKER = "airflow-worker"
# The workers: the main one, and the benchmark's own (one image, the one with torch).
WORKERS = {WORKER, "airflow-bench-worker"}
# The stack's secrets: compose must refuse to start without each (no default anywhere).
SECRETS = (
    "AIRFLOW_FERNET_KEY",
    "AIRFLOW_JWT_SECRET",
    "BURSTCV_SERVING_ADMIN_TOKEN",
    "POSTGRES_PASSWORD",
    "AIRFLOW_ADMIN_PASSWORD",
)
STACK_HOME = "/opt/burstcv"
# The Settings classes each kind of container reads, by env prefix (longest prefix wins).
AIRFLOW_SETTINGS: list[type[BaseSettings]] = [PipelineSettings, Ec2Settings]
SERVING_SETTINGS: list[type[BaseSettings]] = [ServingSettings]
_INTERPOLATION = re.compile(r"(?<!\$)\$\{([A-Z0-9_]+)(?::?[-?][^}]*)?\}")
_DEFAULTED = re.compile(r"\$\{[A-Z0-9_]+:?-([^}]*)\}")
# `$$` (a literal dollar), or ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?err}, ...
_SUBSTITUTION = re.compile(r"\$\$|\$\{([A-Z0-9_]+)(?:(:?[-?])([^}]*))?\}")
# A line of .env.example that sets NAME, or shows it commented out (`# NAME=...`).
_EXAMPLE_LINE = re.compile(r"^\s*(?:#\s*)?([A-Z][A-Z0-9_]*)=")


def with_defaults(value: str) -> str:
    """Return a compose value with each ``${NAME:-default}`` replaced by its default."""
    return _DEFAULTED.sub(lambda m: m.group(1), value)


def interpolate(value: str, given: Mapping[str, str]) -> str:
    """Return a compose value as compose interpolates it with the variables ``given``.

    ``${NAME:?err}`` fails the test when NAME is unset or empty (compose would refuse to start).
    """

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1), match.group(2), match.group(3)
        value = given.get(name)
        if op in (":-", ":?") and not value:
            value = None
        if value is not None:
            return value
        if op in (":?", "?"):
            pytest.fail(f"compose refuses to start without {name}: {arg}")
        return arg if op in (":-", "-") else ""

    return _SUBSTITUTION.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """Return docker-compose.yaml parsed (YAML anchors and merge keys resolved)."""
    return yaml.safe_load(COMPOSE.read_text())


def env_of(service: dict[str, Any]) -> dict[str, str]:
    """Return a service's environment as a dict (compose allows a list or a mapping)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool

    @property
    def bind(self) -> bool:
        return self.source.startswith((".", "/", "~"))


def mounts_of(service: dict[str, Any]) -> list[Mount]:
    """Return a service's volumes (the short `source:target[:mode]` or the long syntax)."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            read_only = bool(volume.get("read_only", False))
            out.append(Mount(str(volume.get("source", "")), volume["target"], read_only))
            continue
        source, target, *mode = str(volume).split(":")
        out.append(Mount(source, target, "ro" in ",".join(mode).split(",")))
    return out


def setting_fields(classes: list[type[BaseSettings]]) -> dict[str, set[str]]:
    """Return {env prefix: field names} for Settings classes."""
    return {
        str(cls.model_config.get("env_prefix", "")).upper(): set(cls.model_fields)
        for cls in classes
    }


def unknown_settings(env: dict[str, str], classes: list[type[BaseSettings]]) -> list[str]:
    """Return the BURSTCV_* names in env that no Settings class of the container reads."""
    fields = setting_fields(classes)
    unknown = []
    for name in env:
        if not name.startswith("BURSTCV_"):
            continue
        prefixes = sorted((p for p in fields if name.startswith(p)), key=len, reverse=True)
        if not any(name[len(p) :].lower() in fields[p] for p in prefixes):
            unknown.append(name)
    return unknown


def use_container_env(
    monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str], given: Mapping[str, str]
) -> None:
    """Make this process's burstcv/AWS environment a container's, compose defaults applied.

    The test session's own BURSTCV_*, AWS_* and AIRFLOW_CONN_* variables are cleared first.
    """
    for name in list(os.environ):
        if name.startswith(("BURSTCV_", "AWS_", "AIRFLOW_CONN_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith(("BURSTCV_", "AWS_", "AIRFLOW_CONN_")):
            monkeypatch.setenv(name, interpolate(value, given))


# Stand-in values for the secrets compose requires (what `make stack-env` would write).
SECRET_VALUES = {name: f"test-{name.lower()}-0123456789abcdef" for name in SECRETS}


# .dockerignore, as Docker reads it: the last pattern that matches a path, or one of its
# parent folders, decides; `!` re-includes; `**` matches any number of folders.


def dockerignore_patterns(text: str) -> list[tuple[bool, tuple[str, ...]]]:
    """Return (negated, path segments) for each pattern of a .dockerignore."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = posixpath.normpath(line.removeprefix("!").strip().strip("/"))
        patterns.append((negated, tuple(pattern.split("/"))))
    return patterns


def _segments_match(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_segments_match(pattern[1:], parts[i:]) for i in range(len(parts) + 1))
    return (
        bool(parts)
        and fnmatch.fnmatchcase(parts[0], pattern[0])
        and _segments_match(pattern[1:], parts[1:])
    )


def ignored(path: str, patterns: list[tuple[bool, tuple[str, ...]]]) -> bool:
    """Return whether .dockerignore's ``patterns`` leave ``path`` out of the build context."""
    parts = PurePosixPath(path).parts
    result = False
    for negated, pattern in patterns:
        if any(_segments_match(pattern, parts[:n]) for n in range(1, len(parts) + 1)):
            result = not negated
    return result


@pytest.fixture(scope="module")
def ignore() -> list[tuple[bool, tuple[str, ...]]]:
    return dockerignore_patterns(DOCKERIGNORE.read_text())


# Dockerfiles: each stage's base and what it copies and runs.


@dataclass
class Stage:
    base: str
    copies: list[tuple[list[str], str, str | None]] = field(
        default_factory=list
    )  # srcs, dest, from
    runs: list[str] = field(default_factory=list)


def dockerfile_stages(path: Path) -> dict[str, Stage]:
    """Return the stages of a Dockerfile by name (an unnamed stage by its index)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(base=words[0])
        elif instruction == "COPY":
            assert current is not None, f"{path}: COPY before FROM"
            words = rest.split()
            source_stage = next(
                (w.split("=", 1)[1] for w in words if w.startswith("--from=")), None
            )
            args = [w for w in words if not w.startswith("--")]
            current.copies.append((args[:-1], args[-1], source_stage))
        elif instruction == "RUN":
            assert current is not None, f"{path}: RUN before FROM"
            current.runs.append(rest)
    return stages


def stage_chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """Return the stage ``target`` and the stages it is built FROM, target first."""
    chain = [stages[target]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def copied_sources(chain: list[Stage]) -> set[str]:
    """Return the build-context paths a chain of stages copies in (slashes stripped)."""
    return {
        s.rstrip("/") for stage in chain for srcs, _, frm in stage.copies if not frm for s in srcs
    }


def builds_of(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s["build"] for name, s in compose["services"].items() if "build" in s}


def test_stack_has_the_official_layout(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(AIRFLOW_SERVICES) | INFRA == set(services)
    for name, command in AIRFLOW_SERVICES.items():
        assert services[name]["command"].split()[: len(command.split())] == command.split()
        env = env_of(services[name])
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:6379/")
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith(
            "http://airflow-apiserver:8080/"
        )
        assert env["BURSTCV_HOME"] == STACK_HOME
        assert "healthcheck" in services[name], name
        depends = services[name]["depends_on"]
        assert depends["airflow-init"]["condition"] == "service_completed_successfully"
        assert depends["postgres"]["condition"] == "service_healthy"
    assert services["moto"]["profiles"] == ["aws-emulator"]
    assert "profiles" not in services["serving"]
    # airflow-init refuses weak secrets before anything else starts.
    init = services["airflow-init"]
    script = "\n".join(init["command"]) if isinstance(init["command"], list) else init["command"]
    assert "burstcv check-stack" in script and "burstcv stack-passwords" in script
    assert script.index("burstcv check-stack") < script.index("airflow db migrate")


def test_each_airflow_service_builds_its_own_target(compose: dict[str, Any]) -> None:
    builds = builds_of(compose)
    assert set(builds) == {*AIRFLOW_IMAGE_SERVICES, "serving"}
    stages = dockerfile_stages(REPO / AIRFLOW_DOCKERFILE)
    images: dict[str, set[str]] = {}
    for name in AIRFLOW_IMAGE_SERVICES:
        build = builds[name]
        assert (REPO / build["context"]).resolve() == REPO, name
        assert build["dockerfile"] == AIRFLOW_DOCKERFILE, name
        expected = "worker" if name in WORKERS else "airflow"
        assert build["target"] == expected, f"{name} builds {build['target']}"
        assert build["target"] in stages, f"{name}: no stage {build['target']}"
        images.setdefault(build["target"], set()).add(compose["services"][name]["image"])
    # One image name per target: two targets tagging one name would overwrite each other.
    assert all(len(names) == 1 for names in images.values()), images
    assert images["worker"].isdisjoint(images["airflow"]), images
    serving = builds["serving"]
    assert (REPO / serving["context"]).resolve() == REPO
    assert serving["dockerfile"] == "serving/Dockerfile" and "target" not in serving
    assert compose["services"]["serving"]["image"] not in images["worker"] | images["airflow"]


def test_the_dockerignore_matcher_reads_patterns_as_docker_does(
    ignore: list[tuple[bool, tuple[str, ...]]],
) -> None:
    # Left out: everything not re-included, and bytecode even inside what is.
    for path in (
        "var",
        "var/registry/digits/v1/model.onnx",
        ".venv/bin/python",
        ".env",
        "tests/test_cli.py",
        "docker/locks.py",
        "src/burstcv/__pycache__/cli.cpython-311.pyc",
        "serving/burstcv_serving/x.pyo",
        "src/burstcv.egg-info/PKG-INFO",
    ):
        assert ignored(path, ignore), path
    # Kept: what the Dockerfiles copy.
    for path in (
        "pyproject.toml",
        "src/burstcv/settings.py",
        "serving/burstcv_serving/__main__.py",
        "dags/burstcv_pipeline.py",
        TRAIN_LOCK,
        "tests/stack/standins/airflow.Containerfile",
    ):
        assert not ignored(path, ignore), path
    # The rules themselves: the last match decides, `**` spans folders, `!x/` re-includes.
    rules = dockerignore_patterns("**\n!keep/\n**/drop\n!keep/drop/again.txt\n")
    assert ignored("other.txt", rules) and not ignored("keep/a/b.txt", rules)
    assert ignored("keep/a/drop/b.txt", rules) and ignored("keep/drop", rules)
    assert not ignored("keep/drop/again.txt", rules)


def test_copied_sources_exist_in_the_build_context(
    compose: dict[str, Any], ignore: list[tuple[bool, tuple[str, ...]]]
) -> None:
    dockerfiles = {
        (REPO / b["context"]).resolve() / b["dockerfile"] for b in builds_of(compose).values()
    }
    assert len(dockerfiles) == 2
    for dockerfile in dockerfiles:
        assert dockerfile.is_file(), dockerfile
        sources = copied_sources(list(dockerfile_stages(dockerfile).values()))
        assert sources, dockerfile
        for source in sources:
            what = f"{dockerfile.relative_to(REPO)}: COPY {source}"
            path = REPO / source
            assert path.exists(), f"{what}: no such path"
            assert not ignored(source, ignore), f"{what}: left out by .dockerignore"
            if path.is_dir():
                kept = [
                    f
                    for f in path.rglob("*")
                    if f.is_file() and not ignored(f.relative_to(REPO).as_posix(), ignore)
                ]
                assert kept, f"{what}: .dockerignore leaves none of its files"


def test_only_the_worker_image_installs_torch(compose: dict[str, Any]) -> None:
    stages = dockerfile_stages(REPO / AIRFLOW_DOCKERFILE)
    for name, build in builds_of(compose).items():
        if name not in AIRFLOW_IMAGE_SERVICES:
            continue
        chain = stage_chain(stages, build["target"])
        runs = " ".join(run for stage in chain for run in stage.runs)
        trains = TRAIN_LOCK in copied_sources(chain)
        assert trains == (name in WORKERS), f"{name} ({build['target']}) installs torch: {trains}"
        assert ("requirements-train.txt" in runs) == (name in WORKERS), name
        # Every Airflow image installs the runtime lock (the worker through its FROM airflow).
        assert RUNTIME_LOCK in copied_sources(chain) and "requirements-runtime.txt" in runs
    serving = REPO / "serving" / "Dockerfile"
    assert "requirements-train" not in serving.read_text()
    assert TRAIN_LOCK not in copied_sources(list(dockerfile_stages(serving).values()))


def test_dags_and_the_plugin_are_baked_into_the_airflow_image() -> None:
    stages = dockerfile_stages(REPO / AIRFLOW_DOCKERFILE)
    copies = {
        src.rstrip("/"): dest.rstrip("/")
        for srcs, dest, frm in stage_chain(stages, "airflow")[0].copies
        if not frm
        for src in srcs
    }
    assert copies["dags"] == "/opt/airflow/dags"
    assert copies["plugins"] == "/opt/airflow/plugins"
    assert (REPO / "dags" / "burstcv_pipeline.py").is_file()
    assert (REPO / "plugins" / "burstcv_plugin.py").is_file()


def test_state_lives_in_named_volumes_never_in_the_checkout(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used: set[str] = set()
    for name, service in compose["services"].items():
        for mount in mounts_of(service):
            if mount.bind:
                host = (REPO / mount.source).resolve()
                assert host.exists(), f"{name}: bind mount of missing {mount.source}"
                # var/ is the embedded default's state: the stack keeps its own.
                assert not host.is_relative_to(REPO / "var"), f"{name} mounts {mount.source}"
            else:
                assert mount.source in declared, f"{name}: undeclared volume {mount.source}"
                used.add(mount.source)
    assert used == declared, declared - used
    assert {"burstcv-home", "airflow-logs", "airflow-auth"} <= declared
    common = {(m.source, m.target) for m in mounts_of(compose["x-airflow-common"])}
    assert common == {("burstcv-home", STACK_HOME), ("airflow-logs", "/opt/airflow/logs")}
    for name in AIRFLOW_IMAGE_SERVICES:
        home = env_of(compose["services"][name])["BURSTCV_HOME"]
        mounted = {m.target: m for m in mounts_of(compose["services"][name])}
        assert mounted[home].source == "burstcv-home" and not mounted[home].read_only, name
    # Only airflow-init and the api-server (whose auth manager opens it for update) mount the
    # passwords file; no other component sees it.
    auth = {
        name: m.read_only
        for name, s in compose["services"].items()
        for m in mounts_of(s)
        if m.source == "airflow-auth"
    }
    assert auth == {"airflow-init": False, "airflow-apiserver": False}


def test_the_service_reads_the_registry_the_pipeline_writes(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = compose["services"]["serving"]
    serving_uri = env_of(serving)["BURSTCV_SERVING_REGISTRY_URI"]
    (home_mount,) = [m for m in mounts_of(serving) if m.source == "burstcv-home"]
    assert home_mount.read_only  # the pipeline's deploy task writes it, never the service
    in_volume = PurePosixPath(serving_uri).relative_to(home_mount.target)
    for name in AIRFLOW_IMAGE_SERVICES:
        env = env_of(compose["services"][name])
        with monkeypatch.context() as patch:
            use_container_env(patch, env, SECRET_VALUES)
            registry = PipelineSettings().registry_uri
        assert registry == serving_uri, name
        (mount,) = [m for m in mounts_of(compose["services"][name]) if m.source == "burstcv-home"]
        assert PurePosixPath(registry).relative_to(mount.target) == in_volume, name


def test_a_local_stack_reaps_only_local_compute(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = COMPOSE.read_text()
    assert "${AIRFLOW_CONN_AWS_DEFAULT:-}" in text
    assert not re.search(r"\$\{AIRFLOW_CONN_AWS_DEFAULT:?-[^}]", text)
    for name in AIRFLOW_IMAGE_SERVICES:
        env = env_of(compose["services"][name])
        assert env["AIRFLOW_CONN_AWS_DEFAULT"] == "${AIRFLOW_CONN_AWS_DEFAULT:-}", name
        with monkeypatch.context() as patch:
            use_container_env(patch, env, SECRET_VALUES)
            settings = PipelineSettings()
            assert os.environ["AIRFLOW_CONN_AWS_DEFAULT"] == ""
            assert settings.reaper_backend_names() == ["local"], name
            assert settings.compute_backend == "local"
    # The check sees AWS when it is configured: with a connection, the reaper sweeps EC2 too.
    with monkeypatch.context() as patch:
        given = {**SECRET_VALUES, "AIRFLOW_CONN_AWS_DEFAULT": '{"conn_type": "aws"}'}
        use_container_env(patch, env_of(compose["services"][WORKER]), given)
        assert PipelineSettings().reaper_backend_names() == ["local", "ec2"]


def test_the_benchmark_has_a_worker_of_its_own_serving_its_queue_alone(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    queue = interpolate(env_of(services[WORKER])["BURSTCV_BENCH_QUEUE"], {})
    assert queue == "burstcv_bench"
    bench = services["airflow-bench-worker"]
    args = interpolate(bench["command"], {}).split()
    assert args[args.index("--queues") + 1] == queue  # that queue alone
    assert args[args.index("--concurrency") + 1] == "1"  # one measurement at a time
    assert "--queues" not in services[WORKER]["command"]  # the default queue: every other task
    # The DAG, parsed with the stack's setting, sends the benchmark there and nothing else.
    parse = (
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(REPO / 'dags' / 'burstcv_pipeline.py')!r})\n"
        "dag = bag.get_dag('burstcv_pipeline')\n"
        "print(sorted({t.task_id for t in dag.tasks if t.queue == 'burstcv_bench'}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", parse],
        env={**os.environ, "BURSTCV_BENCH_QUEUE": queue},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "['benchmark']", result.stdout


def test_commands_name_real_airflow_commands_and_modules(compose: dict[str, Any]) -> None:
    for name, command in AIRFLOW_SERVICES.items():
        args = [*command.split(), "--help"]
        result = subprocess.run(
            [sys.executable, "-m", "airflow", *args], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{name}: airflow {command}: {result.stderr[-500:]}"
    worker_check = " ".join(compose["services"][WORKER]["healthcheck"]["test"])
    app_module = re.search(r"--app (\S+)\.app", worker_check)
    assert app_module is not None
    __import__(app_module.group(1))
    # The serving image's CMD runs the package that its Dockerfile copies in.
    serving_dockerfile = (REPO / "serving" / "Dockerfile").read_text()
    assert '"-m", "burstcv_serving"' in serving_dockerfile
    assert (REPO / "serving" / "burstcv_serving" / "__main__.py").is_file()


@pytest.mark.parametrize(
    ("service", "classes"),
    [*((name, AIRFLOW_SETTINGS) for name in AIRFLOW_IMAGE_SERVICES), ("serving", SERVING_SETTINGS)],
)
def test_every_burstcv_variable_is_a_real_setting(
    compose: dict[str, Any], service: str, classes: list[type[BaseSettings]]
) -> None:
    env = env_of(compose["services"][service])
    assert any(k.startswith("BURSTCV_") for k in env)
    assert unknown_settings(env, classes) == []


def test_the_settings_check_would_catch_a_typo() -> None:
    assert unknown_settings({"BURSTCV_ARTIFACT_ROOTS": "x"}, AIRFLOW_SETTINGS) == [
        "BURSTCV_ARTIFACT_ROOTS"
    ]
    assert unknown_settings({"BURSTCV_SERVING_URL": "x"}, SERVING_SETTINGS) == [
        "BURSTCV_SERVING_URL"
    ]
    assert unknown_settings({"BURSTCV_SERVING_URL": "x"}, AIRFLOW_SETTINGS) == []
    assert unknown_settings({"BURSTCV_EC2_INSTANCE_PROFILES": "x"}, AIRFLOW_SETTINGS) == [
        "BURSTCV_EC2_INSTANCE_PROFILES"
    ]


def test_ports_bind_loopback_without_clashes(compose: dict[str, Any]) -> None:
    published: list[str] = []
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            host_ip, host_port, container_port = with_defaults(str(port)).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {port} on every interface"
            assert 0 < int(container_port) < 65536 and 1024 <= int(host_port) < 65536
            published.append(host_port)
        if name in ("postgres", "redis"):
            assert "ports" not in service, f"{name} must stay on the compose network"
    assert len(published) == len(set(published)), published
    api = compose["services"]["airflow-apiserver"]
    assert "--port 8080" in api["command"] and api["ports"][0].endswith(":8080")
    serving_env = env_of(compose["services"]["serving"])
    serving_port = serving_env["BURSTCV_SERVING_PORT"]
    assert compose["services"]["serving"]["ports"][0].endswith(f":{serving_port}")
    assert env_of(compose["services"][WORKER])["BURSTCV_SERVING_URL"] == (
        f"http://serving:{serving_env['BURSTCV_SERVING_PORT']}"
    )


def test_secrets_are_required_and_never_defaulted(compose: dict[str, Any]) -> None:
    text = COMPOSE.read_text()
    for name in SECRETS:
        uses = re.findall(rf"(?<!\$)\$\{{{name}(?=[-:?}}])((?::?[-?])?)[^}}]*\}}", text)
        assert ":?" in uses, f"{name} is not required (${{{name}:?...}}) anywhere"
        assert not {"-", ":-"} & set(uses), f"{name} has a default"
    # Each reaches the setting that uses it (as compose interpolates the file).
    given = {name: f"<{name}>" for name in SECRETS}
    init = {
        k: interpolate(v, given) for k, v in env_of(compose["services"]["airflow-init"]).items()
    }
    assert init["AIRFLOW__CORE__FERNET_KEY"] == "<AIRFLOW_FERNET_KEY>"
    assert init["AIRFLOW__API_AUTH__JWT_SECRET"] == "<AIRFLOW_JWT_SECRET>"
    assert init["AIRFLOW_ADMIN_PASSWORD"] == "<AIRFLOW_ADMIN_PASSWORD>"
    assert init["BURSTCV_SERVING_ADMIN_TOKEN"] == "<BURSTCV_SERVING_ADMIN_TOKEN>"
    assert ":<POSTGRES_PASSWORD>@postgres/" in init["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    serving = {k: interpolate(v, given) for k, v in env_of(compose["services"]["serving"]).items()}
    assert serving["BURSTCV_SERVING_ADMIN_TOKEN"] == "<BURSTCV_SERVING_ADMIN_TOKEN>"
    postgres = env_of(compose["services"]["postgres"])
    assert interpolate(postgres["POSTGRES_PASSWORD"], given) == "<POSTGRES_PASSWORD>"
    # Without one, compose refuses to start.
    with pytest.raises(pytest.fail.Exception, match="AIRFLOW_FERNET_KEY"):
        interpolate(env_of(compose["services"]["airflow-init"])["AIRFLOW__CORE__FERNET_KEY"], {})


def test_env_example_documents_every_variable_compose_reads(compose: dict[str, Any]) -> None:
    del compose
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    referenced = set(_INTERPOLATION.findall(text))
    lines = ENV_EXAMPLE.read_text().splitlines()
    documented = {m.group(1) for line in lines if (m := _EXAMPLE_LINE.match(line))}
    set_lines = {
        line.split("=", 1)[0] for line in lines if "=" in line and not line.startswith("#")
    }
    assert required == set(SECRETS), required ^ set(SECRETS)
    # Required variables must be set (make stack-env fills them), not merely mentioned.
    assert required <= set_lines, required - set_lines
    assert referenced <= documented, sorted(referenced - documented)
    # And .env.example names nothing compose does not read.
    assert documented <= referenced, sorted(documented - referenced)
    serving = ServingSettings.model_fields
    assert "admin_token" in serving  # the token the service checks is the one deploy sends
    assert "serving_admin_token" in PipelineSettings.model_fields
