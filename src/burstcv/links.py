"""Say where each run artifact a browser may open is served, once for every page that links it.

The plugin serves them at ``/burstcv/runs/<run key>/<path in the run folder>``: the store's own
layout, so a relative link between pages resolves the same way through the plugin and in a
local artifact folder.
"""

from __future__ import annotations

import posixpath
from urllib.parse import quote

from burstcv_spec.storage import safe_run_id

URL_PREFIX = "/burstcv"  # where the plugin's app is mounted in the Airflow api-server
DAG_ID = "burstcv_pipeline"
INDEX = "index.html"
# The trees of a run folder (runs/<run key>/...) that a browser may read, by page name.
SERVED_TREES: dict[str, tuple[str, ...]] = {
    "data-docs": ("dataset", "data_docs"),  # Great Expectations Data Docs (validate)
    "report": ("report",),  # the run's one-page HTML report (report)
}


def tree_path(page: str) -> str:
    """Return the folder of a served page inside the run folder, e.g. ``dataset/data_docs``."""
    try:
        return "/".join(SERVED_TREES[page])
    except KeyError:
        raise ValueError(
            f"unknown served page {page!r}; choose {', '.join(SERVED_TREES)}"
        ) from None


def page_url(run_id: str, page: str, path: str = INDEX) -> str:
    """Return the absolute plugin URL of ``path`` in a run's served tree (Airflow run id or key)."""
    return f"{URL_PREFIX}/runs/{safe_run_id(run_id)}/{tree_path(page)}/{path}"


def link_between(from_page: str, to_page: str) -> str:
    """Return the relative URL from one served page's index to another's, of the same run."""
    start = posixpath.dirname(f"{tree_path(from_page)}/{INDEX}")
    return posixpath.relpath(f"{tree_path(to_page)}/{INDEX}", start)


def served_page_of(path: str) -> str | None:
    """Return the served page whose tree holds ``path`` (relative to the run folder), or None."""
    segments = path.split("/")
    for page, tree in SERVED_TREES.items():
        if tuple(segments[: len(tree)]) == tree:
            return page
    return None


def airflow_run_path(run_id: str, dag_id: str = DAG_ID) -> str:
    """Return the Airflow UI's path (below its base URL) of a DAG run's page."""
    return f"/dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}"


MODELS_PAGE = URL_PREFIX + "/"  # the plugin's Models page


def from_page(run_id: str, page: str, target: str) -> str:
    """Return ``target`` (a path on the Airflow host) relative to a run's served page.

    Relative, so it survives a proxy's path prefix; it resolves only through Airflow.
    """
    here = posixpath.dirname(page_url(run_id, page))
    relative = posixpath.relpath(target, here)
    return relative + "/" if target.endswith("/") else relative
