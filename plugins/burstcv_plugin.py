"""Register burstcv's Airflow UI extensions: task links to run artifacts, the models page.

Only Airflow's plugin base, FastAPI and burstcv's settings/registry/storage are imported (no
torch, numpy or pandas): every Airflow process loads plugins.
"""

from __future__ import annotations

from typing import Any, ClassVar
from urllib.parse import urlparse

import burstcv_views  # the plugins folder is on sys.path; see that module's docstring
from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink

from burstcv import links
from burstcv.settings import get_settings
from burstcv_spec import storage


def _base_path() -> str:
    """Return the api-server's path prefix (from ``[api] base_url``), '' at the root."""
    from airflow.configuration import conf

    base_url = conf.get("api", "base_url", fallback="") or ""
    return urlparse(base_url).path.rstrip("/")


class _RunArtifactLink(BaseOperatorLink):
    """Link one task of burstcv_pipeline to a page its run wrote, if the page exists."""

    task_id: ClassVar[str]
    page: ClassVar[str]  # a served page of burstcv.links: the link opens its index.html

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        """Return the plugin URL of the page, or '' (no link shown) for other tasks."""
        if ti_key.dag_id != links.DAG_ID or ti_key.task_id != self.task_id:
            return ""
        run_key = burstcv_views.safe_run_id(ti_key.run_id)
        index = (*links.SERVED_TREES[self.page], links.INDEX)
        if not storage.exists(storage.join(get_settings().artifact_root, "runs", run_key, *index)):
            return ""
        return _base_path() + links.page_url(ti_key.run_id, self.page)


class DataDocsLink(_RunArtifactLink):
    """Link the validate task to the Great Expectations Data Docs of its run."""

    name = "Data Docs"
    task_id = "validate"
    page = "data-docs"


class RunReportLink(_RunArtifactLink):
    """Link the report task to the run's one-page HTML report."""

    name = "Run report"
    task_id = "report"
    page = "report"


class DeployedModelLink(BaseOperatorLink):
    """Link the deploy task to the deployed service's ``/v1/model`` (what it now serves)."""

    name = "Deployed model"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        """Return ``<first BURSTCV_SERVING_URL>/v1/model``, or '' when deploy is registry-only."""
        if ti_key.dag_id != links.DAG_ID or ti_key.task_id != "deploy":
            return ""
        first = get_settings().serving_url.split(",")[0].strip().rstrip("/")
        return f"{first}/v1/model" if first else ""


class BurstcvPlugin(AirflowPlugin):
    """Add burstcv's task links, its models/costs app and a nav entry to Airflow."""

    name = "burstcv"
    # Global: @task functions share one operator class, so each link picks its task by id
    # and returns '' (hidden) for the others.
    global_operator_extra_links: ClassVar[list[Any]] = [
        DataDocsLink(),
        RunReportLink(),
        DeployedModelLink(),
    ]
    fastapi_apps: ClassVar[list[Any]] = [
        {"app": burstcv_views.app, "url_prefix": links.URL_PREFIX, "name": "burstcv"}
    ]
    external_views: ClassVar[list[Any]] = [
        {
            "name": "Models",
            "href": f"{links.URL_PREFIX}/",
            "icon": f"{links.URL_PREFIX}/icon.svg",
            "url_route": "burstcv",
            "destination": "nav",
            "nav_top_level": True,
        }
    ]
