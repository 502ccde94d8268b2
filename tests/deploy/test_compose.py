"""docker-compose.yaml names only things that exist: files, modules, settings, sane ports.

No Docker engine runs here, so the file is checked statically: every build context,
Dockerfile, mounted host path and command points into this repo; every ``BURSTCV_*`` variable
is a field of the Settings class the container's process reads; ports bind 127.0.0.1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic_settings import BaseSettings

from burstcv.compute.ec2 import Ec2Settings
from burstcv.settings import Settings as PipelineSettings
from burstcv_serving.settings import Settings as ServingSettings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
AIRFLOW_SERVICES = {
    "airflow-apiserver": "api-server",
    "airflow-scheduler": "scheduler",
    "airflow-dag-processor": "dag-processor",
    "airflow-triggerer": "triggerer",
    "airflow-worker": "celery worker",
}
INFRA = {"postgres", "redis", "airflow-init", "serving", "moto"}
# The Settings classes each kind of container reads, by env prefix (longest prefix wins).
AIRFLOW_SETTINGS: list[type[BaseSettings]] = [PipelineSettings, Ec2Settings]
SERVING_SETTINGS: list[type[BaseSettings]] = [ServingSettings]
_INTERPOLATION = re.compile(r"(?<!\$)\$\{([A-Z0-9_]+)(?::?[-?][^}]*)?\}")
_DEFAULTED = re.compile(r"\$\{[A-Z0-9_]+:?-([^}]*)\}")


def with_defaults(value: str) -> str:
    """Return a compose value with each ``${NAME:-default}`` replaced by its default."""
    return _DEFAULTED.sub(lambda m: m.group(1), value)


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
        assert "healthcheck" in services[name], name
        depends = services[name]["depends_on"]
        assert depends["airflow-init"]["condition"] == "service_completed_successfully"
        assert depends["postgres"]["condition"] == "service_healthy"
    assert services["moto"]["profiles"] == ["aws-emulator"]
    assert "profiles" not in services["serving"]


def test_build_contexts_dockerfiles_and_copied_paths_exist(compose: dict[str, Any]) -> None:
    builds = [s["build"] for s in compose["services"].values() if "build" in s]
    assert len(builds) == len(AIRFLOW_SERVICES) + 2  # + airflow-init + serving
    for build in builds:
        context = (REPO / build["context"]).resolve()
        dockerfile = context / build["dockerfile"]
        assert context == REPO
        assert dockerfile.is_file(), dockerfile
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    assert (context / source).exists(), f"{dockerfile.name}: COPY {source}"


def test_mounted_host_paths_exist(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            host = volume.split(":", 1)[0]
            if host.startswith("./var"):
                continue  # var/ is git-ignored: created by `make` and by airflow-init
            if host.startswith("./"):
                assert (REPO / host).exists(), f"{name}: {host}"
            else:
                assert host in compose.get("volumes", {}), f"{name}: undeclared volume {host}"
    common = compose["x-airflow-common"]["volumes"]
    assert {v.split(":")[0] for v in common} == {"./dags", "./plugins", "./var"}
    assert (REPO / "dags" / "burstcv_pipeline.py").is_file()
    assert (REPO / "plugins" / "burstcv_plugin.py").is_file()
    serving_env = env_of(compose["services"]["serving"])
    serving_mount = compose["services"]["serving"]["volumes"][0].split(":")
    assert serving_mount[1] == serving_env["BURSTCV_SERVING_REGISTRY_URI"]
    airflow_env = env_of(compose["services"]["airflow-worker"])
    # The service reads the very folder the pipeline's registry writes (both through ./var).
    for name in [n for n in os.environ if n.startswith("BURSTCV_")]:
        monkeypatch.delenv(name)  # the test session's own
    for name, value in airflow_env.items():
        if name.startswith("BURSTCV_"):
            monkeypatch.setenv(name, with_defaults(value))
    assert PipelineSettings().registry_uri == "/opt/burstcv/var/registry"
    assert serving_mount[0] == "./var/registry"


def test_commands_name_real_airflow_commands_and_modules(compose: dict[str, Any]) -> None:
    for name, command in AIRFLOW_SERVICES.items():
        args = [*command.split(), "--help"]
        result = subprocess.run(
            [sys.executable, "-m", "airflow", *args], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"{name}: airflow {command}: {result.stderr[-500:]}"
    worker_check = " ".join(compose["services"]["airflow-worker"]["healthcheck"]["test"])
    app_module = re.search(r"--app (\S+)\.app", worker_check)
    assert app_module is not None
    __import__(app_module.group(1))
    # The serving image's CMD runs the package that its Dockerfile copies in.
    serving_dockerfile = (REPO / "serving" / "Dockerfile").read_text()
    assert '"-m", "burstcv_serving"' in serving_dockerfile
    assert (REPO / "serving" / "burstcv_serving" / "__main__.py").is_file()


@pytest.mark.parametrize(
    ("service", "classes"),
    [*((name, AIRFLOW_SETTINGS) for name in AIRFLOW_SERVICES), ("serving", SERVING_SETTINGS)],
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
    assert env_of(compose["services"]["airflow-worker"])["BURSTCV_SERVING_URL"] == (
        f"http://serving:{serving_env['BURSTCV_SERVING_PORT']}"
    )


def test_env_example_defines_every_variable_compose_requires(compose: dict[str, Any]) -> None:
    del compose
    text = COMPOSE.read_text()
    required = set(re.findall(r"\$\{([A-Z0-9_]+):\?", text))
    referenced = set(_INTERPOLATION.findall(text))
    example = {
        line.split("=", 1)[0]
        for line in (REPO / ".env.example").read_text().splitlines()
        if line and not line.startswith("#") and "=" in line
    }
    assert required <= example, required - example
    assert referenced <= example, referenced - example
    serving = ServingSettings.model_fields
    assert "admin_token" in serving  # the token the service checks is the one deploy sends
    assert "serving_admin_token" in PipelineSettings.model_fields
