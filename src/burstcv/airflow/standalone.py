"""What `make airflow` runs of Airflow (``burstcv.supervisor`` starts and watches them): the
components of ``airflow standalone``, except that the scheduler and triggerer skip their log
servers (which bind every interface; the api-server reads the logs from disk), and the admin
login the UI asks for.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

COMPONENTS: dict[str, tuple[str, ...]] = {
    "api-server": ("api-server",),
    "scheduler": ("scheduler", "--skip-serve-logs"),
    "dag-processor": ("dag-processor",),
    "triggerer": ("triggerer", "--skip-serve-logs"),
}


def airflow() -> list[str]:
    """Return the command that runs this environment's Airflow CLI (its ``airflow`` script)."""
    script = Path(sys.executable).parent / "airflow"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "airflow"]


def prepare_login() -> None:
    """Generate the admin password the UI asks for, as standalone does (once per home)."""
    from airflow.api_fastapi.app import create_auth_manager
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.configuration import conf

    if conf.get("core", "simple_auth_manager_all_admins").lower() == "true":
        return
    manager = create_auth_manager()
    if not isinstance(manager, SimpleAuthManager):
        return  # another auth manager: its own users
    if not os.path.exists(manager.get_generated_password_file()):
        manager.init()


def api_url() -> str:
    """Return the api-server's address from Airflow's configuration ([api] host and port)."""
    from airflow.configuration import conf

    host = conf.get("api", "host", fallback="127.0.0.1") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{conf.getint('api', 'port', fallback=8080)}"
