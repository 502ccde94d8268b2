"""Serve burstcv's pages inside the Airflow api-server: model versions, run costs, run artifacts.

Artifact files are streamed from the store, local or S3. Every route but the nav icon needs
the right to read the DAG. Nothing heavy is imported here: every Airflow process loads it.
"""

from __future__ import annotations

import html
import logging
import mimetypes
import re
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import HTMLResponse, Response

from burstcv import links
from burstcv.links import DAG_ID, URL_PREFIX
from burstcv.params import ResolvedRun
from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry, RegistryError
from burstcv.settings import Settings, get_settings
from burstcv_spec import storage
from burstcv_spec.contracts import (
    Artifact,
    ArtifactError,
    Billing,
    SkipRecord,
    VerdictRecord,
    read_artifact,
)
from burstcv_spec.layout import RunLayout
from burstcv_spec.storage import safe_run_id

A = TypeVar("A", bound=Artifact)
log = logging.getLogger(__name__)

__all__ = ["DAG_ID", "URL_PREFIX", "app", "artifact_uri", "safe_run_id"]

ALIASES = (PRODUCTION, PREVIOUS)
_SAFE_SEGMENT = re.compile(r"^[A-Za-z0-9._+@=,-]+$")
HISTORY_ROWS = 50  # newest alias events on the page; `burstcv models --history` shows more

ICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" '
    'stroke="#017cee" stroke-width="2"><rect x="3" y="4" width="18" height="14" rx="2"/>'
    '<path d="M7 14l3-4 3 3 4-5"/></svg>'
)


def artifact_uri(settings: Settings, run_key: str, path: str) -> str:
    """Return the store URI of ``path`` (relative to the run folder), refusing path traversal.

    Anything but plain segments inside a served tree of a safe run key is a 404, never a file.
    """
    if run_key in ("", ".", "..") or safe_run_id(run_key) != run_key:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such run")
    segments = path.split("/")
    if not path or any(seg in ("", ".", "..") or not _SAFE_SEGMENT.match(seg) for seg in segments):
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such artifact")
    page = links.served_page_of(path)
    if page is None:
        served = ", ".join(f"{links.tree_path(p)}/" for p in links.SERVED_TREES)
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"{path} is not served; only {served} of a run are"
        )
    if path == links.tree_path(page):
        segments.append(links.INDEX)
    base = storage.join(settings.artifact_root, "runs", run_key, *links.SERVED_TREES[page])
    uri = storage.join(settings.artifact_root, "runs", run_key, *segments)
    if not storage.is_s3(uri):
        # Belt and braces for local stores: a symlink must not lead out of the run's tree.
        resolved, root = Path(uri).resolve(), Path(base).resolve()
        if not resolved.is_relative_to(root):
            raise HTTPException(status.HTTP_404_NOT_FOUND, "no such artifact")
    return uri


def _read_or_none(uri: str, model: type[A]) -> A | None:
    """Return the artifact, or None when absent or unreadable: one run never takes the page down."""
    try:
        return read_artifact(uri, model)
    except storage.ArtifactNotFoundError:
        return None
    except ArtifactError as exc:
        log.warning("models page: skipping %s: %s", uri, exc)
        return None


def model_versions(settings: Settings) -> dict[str, Any]:
    """Return the registry as JSON: every version with its status, figures and aliases."""
    registry = Registry(settings.registry_uri, settings.model_name)
    aliases = {name: registry.get_alias(name) for name in ALIASES}
    alias_versions = {name: a.version if a else None for name, a in aliases.items()}
    rows: list[dict[str, Any]] = []
    for version in sorted(registry.versions(), reverse=True):
        try:
            entry = registry.entry(version)
        except RegistryError:  # listed then removed: nothing to show
            continue
        candidate = (entry.benchmark or {}).get("candidate")
        gate = entry.gate
        run_id = entry.lineage.run_id
        rows.append(
            {
                "version": version,
                "status": entry.status,
                "accuracy": candidate.accuracy if candidate else None,
                "p95_ms": candidate.p95_ms if candidate else None,
                # The cheapest CPU fleet for the run's expected load: a costlier version shows.
                "fleet": entry.fleet.model_dump(mode="json") if entry.fleet else None,
                "fleet_measured_in": entry.fleet_measured_in,
                "sizes_url": (
                    links.page_url(entry.fleet_measured_in or run_id, "report") + "#fleet"
                    if entry.fleet and (entry.fleet_measured_in or run_id)
                    else None
                ),
                "aliases": [n for n, v in alias_versions.items() if v == version],
                "reasons": list(gate.reasons) if gate else [],
                "summary": entry.reason or (gate.summary if gate else ""),
                "registered_at": entry.registered_at,
                "run_id": run_id,
                "airflow_run_url": links.airflow_run_path(run_id) if run_id else None,
                "report_url": links.page_url(run_id, "report") if run_id else None,
            }
        )
    return {
        "model": settings.model_name,
        "registry_uri": settings.registry_uri,
        "aliases": alias_versions,
        "versions": rows,
        "history": [  # newest first
            event.model_dump(mode="json", by_alias=True)
            for event in reversed(registry.history(limit=HISTORY_ROWS))
        ],
    }


def _run_keys(runs_uri: str) -> list[str]:
    """Return the run folders under ``runs/``, newest first (by folder time, locally)."""
    if storage.is_s3(runs_uri):
        keys = {
            uri[len(runs_uri) :].lstrip("/").split("/", 1)[0]
            for uri in storage.list_files(runs_uri)
        }
        return sorted((k for k in keys if k), reverse=True)
    root = Path(runs_uri)
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if p.is_dir()]
    return [p.name for p in sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)]


def run_costs(settings: Settings) -> list[dict[str, Any]]:
    """Return one row per run in the artifact store: cost, gate verdict, links to its pages."""
    runs_uri = storage.join(settings.artifact_root, "runs")
    rows: list[dict[str, Any]] = []
    for key in _run_keys(runs_uri):
        run = RunLayout(storage.join(runs_uri, key))
        billing = _read_or_none(run.billing, Billing)
        verdict = _read_or_none(run.verdict, VerdictRecord)
        record = _read_or_none(run.record, ResolvedRun)
        skipped = _read_or_none(run.skip, SkipRecord)
        served = {
            page: storage.exists(storage.join(run.root, links.tree_path(page), links.INDEX))
            for page in links.SERVED_TREES
        }
        # run.json holds the Airflow run id (with ':' and '+'); older runs only have the key.
        run_id = (record.run_id if record else "") or key
        rows.append(
            {
                "run_id": run_id,
                "run_key": key,
                "airflow_run_url": links.airflow_run_path(run_id) if record else None,
                "trigger": record.trigger if record else None,
                "dataset_uri": record.params.dataset_uri if record else None,
                "boxes": record.costs.boxes if record else None,
                "max_cost_usd": record.costs.max_cost_usd if record else None,
                "backend": billing.backend if billing else None,
                "billed_seconds": billing.billed_seconds if billing else None,
                "cost_usd": billing.cost_usd if billing else None,
                "version": verdict.version if verdict else None,
                "promote": verdict.promote if verdict else None,
                "skipped": skipped is not None,
                "summary": (verdict.summary if verdict else None)
                or (skipped.reason if skipped else None),
                "data_docs_url": links.page_url(key, "data-docs") if served["data-docs"] else None,
                "report_url": links.page_url(key, "report") if served["report"] else None,
            }
        )
    return rows


async def require_dag_read(request: Request) -> None:
    """Allow the request only if its user (bearer token or UI cookie) may read the DAG."""
    # Imported here: only the api-server, which has them loaded already, pays for them.
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.api_fastapi.core_api.security import bearer_scheme, get_user

    user = await get_user(request, None, await bearer_scheme(request))
    if not get_auth_manager().is_authorized_dag(
        method="GET", details=DagDetails(id=DAG_ID), user=user
    ):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"not allowed to read DAG {DAG_ID}")


def settings_dep() -> Settings:
    """Return the process's burstcv settings (a dependency, so tests can override it)."""
    return get_settings()


Authorized = Depends(require_dag_read)
SettingsDep = Annotated[Settings, Depends(settings_dep)]

app = FastAPI(
    title="burstcv",
    description="burstcv model versions, run costs and run artifacts, inside Airflow.",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)


@app.get("/icon.svg", include_in_schema=False)
def icon() -> Response:
    """Return the nav icon (public: the browser loads it without credentials)."""
    return Response(ICON_SVG, media_type="image/svg+xml")


@app.get("/api/models", dependencies=[Authorized])
def models_json(settings: SettingsDep) -> dict[str, Any]:
    """Return model versions and per-run costs as JSON."""
    return {**model_versions(settings), "runs": run_costs(settings)}


@app.get("/", response_class=HTMLResponse, dependencies=[Authorized])
def models_page(settings: SettingsDep) -> HTMLResponse:
    """Return the HTML page: model versions and what each run cost."""
    return HTMLResponse(render_page(model_versions(settings), run_costs(settings)))


@app.get("/runs/{run_key}/{path:path}", dependencies=[Authorized])
def run_artifact(run_key: str, path: str, settings: SettingsDep) -> Response:
    """Stream one file (by its path in the run folder) of a run's Data Docs or report."""
    uri = artifact_uri(settings, run_key, path.rstrip("/"))
    try:
        body = storage.read_bytes(uri)
    except (storage.ArtifactNotFoundError, IsADirectoryError) as exc:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"{path} not found") from exc
    media_type = mimetypes.guess_type(uri)[0] or "application/octet-stream"
    return Response(body, media_type=media_type)


def _fmt(value: Any, spec: str, suffix: str = "", prefix: str = "") -> str:
    return "–" if value is None else f"{prefix}{format(value, spec)}{suffix}"


def _link(url: str | None, text: str) -> str:
    # Relative to the page (served at <prefix>/), so a proxy's path prefix is kept.
    if not url:
        return ""
    return f'<a href="{html.escape(url.removeprefix(URL_PREFIX + "/"))}">{html.escape(text)}</a>'


def _airflow_link(url: str | None, text: str) -> str:
    """Return a link to an Airflow UI page (a path below its base URL), or the bare text."""
    if not url:
        return html.escape(text)
    # One level up from <base>/burstcv/ is Airflow's base URL; _top leaves the plugin's frame.
    return f'<a href="..{html.escape(url)}" target="_top">{html.escape(text)}</a>'


def _fleet(version: dict[str, Any], versions: list[dict[str, Any]]) -> str:
    """Return '3 x c7i.large, $195.46/month' for a version's fleet ('–' without one), whose
    sizes it rests on when another run measured them, and a link to those sizes."""
    fleet = version.get("fleet")
    if not fleet:
        return "–"
    month = fleet.get("usd_per_month")
    price = f"${month:,.2f}/month" if month is not None else "unpriced"
    text = f"{fleet['replicas']} x {fleet['instance_type']}, {price}"
    if fleet.get("generator_bound"):
        text += " (at most: the load generator was the limit)"
    if fleet.get("measured_on"):
        text += f" (measured on its own {fleet['measured_on']} box)"
    elif fleet.get("extrapolated"):
        text += " (extrapolated)"
    measured_in = version.get("fleet_measured_in")
    if measured_in and measured_in != version.get("run_id"):
        by = next((v["version"] for v in versions if v.get("run_id") == measured_in), None)
        text += f" (sizes of v{by})" if by is not None else f" (sizes of run {measured_in})"
    curve = _link(version.get("sizes_url"), "p95 against load")
    return html.escape(text) + (f" ({curve})" if curve else "")


def _rows(cells: list[str], none: str, columns: int) -> str:
    """Return the table rows of ``cells`` (each a row's <td>s), or one row saying ``none``."""
    rows = "".join(f"<tr>{row}</tr>" for row in cells)
    return rows or f'<tr><td colspan="{columns}">{none}</td></tr>'


def _version_cells(v: dict[str, Any], versions: list[dict[str, Any]]) -> str:
    e = html.escape
    return (
        f"<td>{v['version']}</td>"
        f'<td class="{e(v["status"])}">{e(v["status"])}</td>'
        f"<td>{_fmt(v['accuracy'], '.4f')}</td>"
        f"<td>{_fmt(v['p95_ms'], '.2f', ' ms')}</td>"
        f"<td>{_fleet(v, versions)}</td>"
        f"<td>{e(', '.join(v['aliases']))}</td>"
        f"<td>{e('; '.join(v['reasons']) or v['summary'])}</td>"
        f"<td>{_airflow_link(v.get('airflow_run_url'), 'run')} "
        f"{_link(v['report_url'], 'report')}</td>"
    )


def _run_cells(r: dict[str, Any]) -> str:
    e = html.escape
    return (
        f"<td>{_airflow_link(r.get('airflow_run_url'), r['run_id'])}</td>"
        f"<td>{e(str(r['trigger'] or '–'))}</td>"
        f"<td>{e(str(r['dataset_uri'] or '–'))}</td>"
        f"<td>{e(str(r['backend'] or '–'))}</td>"
        f"<td>{_fmt(r['boxes'], 'd')}</td>"
        f"<td>{'$0 (skipped)' if r.get('skipped') else _fmt(r['cost_usd'], '.4f', prefix='$')}"
        f" of {_fmt(r['max_cost_usd'], '.4f', prefix='$')}</td>"
        f"<td>{_fmt(r['version'], 'd')}</td>"
        f"<td>{e(r['summary'] or '–')}</td>"
        f"<td>{_link(r['data_docs_url'], 'Data Docs')} {_link(r['report_url'], 'report')}</td>"
    )


def _history_cells(h: dict[str, Any]) -> str:
    def text(key: str) -> str:
        return html.escape(str(h.get(key, "")))

    def moved(key: str) -> str:
        return "–" if h.get(key) is None else str(int(h[key]))

    return (
        f"<td>{text('at')}</td><td>{text('actor')}</td><td>{text('action')}</td>"
        f"<td>{text('alias')}</td><td>{moved('from')} → {moved('to')}</td>"
        f'<td class="{text("result")}">{text("result")}</td><td>{text("detail")}</td>'
    )


def render_page(models: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """Render the versions table and the cost table as one self-contained HTML page."""
    e = html.escape
    versions = models["versions"]
    version_rows = _rows(
        [_version_cells(v, versions) for v in versions], "no versions registered yet", 8
    )
    run_rows = _rows([_run_cells(r) for r in runs], "no runs yet", 9)
    history_rows = _rows(
        [_history_cells(h) for h in models.get("history", [])], "no alias moves recorded yet", 7
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>burstcv models</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5rem; color: #1a202c; }}
table {{ border-collapse: collapse; margin-bottom: 2rem; }}
th, td {{ border-bottom: 1px solid #e2e8f0; padding: .35rem .8rem; text-align: left; }}
th {{ background: #f7fafc; }}
td.accepted, td.moved {{ color: #2f855a; }}
td.rejected, td.refused, td.conflict {{ color: #c53030; }}
code {{ background: #edf2f7; padding: 0 .25rem; }}
</style></head><body>
<h1>burstcv: model <code>{e(models["model"])}</code></h1>
<p>Registry <code>{e(models["registry_uri"])}</code>; production is version
<b>{_fmt(models["aliases"].get(PRODUCTION), "d")}</b>, previous is version
{_fmt(models["aliases"].get(PREVIOUS), "d")}. JSON: <a href="api/models">api/models</a>.</p>
<h2>Versions</h2>
<table id="versions"><thead><tr><th>version</th><th>status</th><th>accuracy (top-1)</th>
<th>p95 latency</th><th>CPU fleet</th><th>alias</th><th>gate</th><th></th></tr></thead>
<tbody>{version_rows}</tbody></table>
<h2>Alias history</h2>
<p>Every move of an alias, and every deploy refused or left alone, newest first.</p>
<table id="history"><thead><tr><th>at</th><th>by</th><th>action</th><th>alias</th>
<th>move</th><th>result</th><th>detail</th></tr></thead>
<tbody>{history_rows}</tbody></table>
<h2>Runs and what they cost</h2>
<table id="runs"><thead><tr><th>run</th><th>trigger</th><th>dataset</th><th>backend</th>
<th>boxes</th><th>cost of budget (USD)</th><th>version</th><th>verdict</th><th>pages</th>
</tr></thead>
<tbody>{run_rows}</tbody></table>
</body></html>
"""
