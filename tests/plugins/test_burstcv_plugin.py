"""The burstcv Airflow plugin: task links, the models/costs page, artifact serving, cheap import.

The app is exercised in-process with FastAPI's TestClient over a real registry and artifact
store in a temp dir (auth is Airflow's, exercised against a real api-server in
tests/dags/test_trigger_api.py); Airflow's own plugin manager loads the plugin.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urljoin

import pytest
from burstcv_testkit import chromium_screenshot, g6_box_rate, gate_decision, write_model_dir
from fastapi.testclient import TestClient

from burstcv.cost.model import time_budget
from burstcv.params import ResolvedRun, RunParams
from burstcv.registry.registry import PRODUCTION, AliasConflictError, Registry
from burstcv.settings import Settings
from burstcv_spec.contracts import FleetOption, RegistryDecision, RunCosts, write_artifact

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugins"))

import burstcv_plugin  # noqa: E402
import burstcv_views  # noqa: E402

RUN_ID = "manual__2026-11-29T10:00:00+00:00"
RUN_KEY = "manual__2026-11-29T10_00_00_00_00"
BOX_RATE = g6_box_rate()


def write_run_json(
    run: Path, run_id: str, *, trigger: str, dataset_uri: str, boxes: int, max_cost_usd: float
) -> None:
    """Write run.json as the run's first task resolves it: an EC2 run of ``boxes`` boxes."""
    params = RunParams.resolve(
        {
            "dataset_uri": dataset_uri,
            "compute_backend": "ec2",
            "instance_types": ["g6.xlarge"],
            "num_nodes": boxes,
            "max_cost_usd": max_cost_usd,
            "time_budget_s": 3600,
        }
    )
    seconds, reason = time_budget(max_cost_usd, 3600, boxes=boxes, rate=BOX_RATE, margin_s=360)
    resolved = ResolvedRun(
        run_id=run_id,
        trigger=trigger,
        started_at="2026-11-29T10:00:01+00:00",
        params=params,
        costs=RunCosts(
            region="us-east-1",
            boxes=boxes,
            max_cost_usd=max_cost_usd,
            box_rate=BOX_RATE,
            time_budget_s=seconds,
            margin_s=360,
            budget_reason=reason,
            serving=[],
            serving_unpriced="no on-demand price for c7i.large in us-east-1: set one",
        ),
    )
    write_artifact(str(run / "run.json"), resolved)


def fleet(usd_per_month: float | None) -> FleetOption:
    """Return the sizing's chosen fleet: 3 x c7i.large, priced (or not: None)."""
    per_hour = None if usd_per_month is None else round(usd_per_month / 730, 4)
    return FleetOption(
        instance_type="c7i.large",
        vcpus=2,
        memory_gib=4.0,
        replicas=3,
        rps_per_replica=270.0,
        extrapolated=False,
        usd_per_hour=per_hour,
        usd_per_month=usd_per_month,
        usd_per_million=None if usd_per_month is None else 0.1487,
    )


def seed_store(root: Path) -> Settings:
    """Write one run (run.json, Data Docs, report, billing, verdict) and two registry versions.

    Version 1's fleet is priced; version 2's serving types had no price (unpriced).
    """
    settings = Settings(
        artifact_root=str(root / "artifacts"),
        registry_uri=str(root / "registry"),
        serving_url="http://127.0.0.1:8123,http://127.0.0.1:8124",
    )
    run = root / "artifacts" / "runs" / RUN_KEY
    (run / "dataset" / "data_docs" / "static").mkdir(parents=True)
    (run / "dataset" / "data_docs" / "index.html").write_text("<html>data docs</html>")
    (run / "dataset" / "data_docs" / "static" / "style.css").write_text("body {}")
    (run / "report").mkdir(parents=True)
    (run / "report" / "index.html").write_text("<html>run report</html>")
    write_run_json(
        run, RUN_ID, trigger="manual", dataset_uri="s3://bucket/digits/v7", boxes=2, max_cost_usd=5
    )
    (run / "job").mkdir()
    billing = {"backend": "ec2", "billed_seconds": {"i-1": 600}, "cost_usd": 0.1234}
    (run / "job" / "billing.json").write_text(
        json.dumps(
            {**billing, "instance_ids": ["i-1"], "instances": [], "terminated_at": "2026-11-29"}
        )
    )
    (run / "bench").mkdir()
    gate = gate_decision(0.91, 71.0, ["p95 too slow"])["gate"]
    (run / "bench" / "verdict.json").write_text(json.dumps({"version": 2, **gate}))
    (root / "secret.txt").write_text("do not serve")
    registry = Registry(settings.registry_uri, settings.model_name)
    for accuracy, status, reasons, usd_per_month in (
        (0.97, "accepted", [], 195.46),
        (0.91, "rejected", ["p95 71.0 ms > SLO 50.0 ms"], None),
    ):
        model_dir = write_model_dir(
            root / f"model-{accuracy}", f"fake onnx {accuracy}".encode(), run_id=RUN_ID
        )
        decision = gate_decision(accuracy, 12.5, reasons)
        assert decision["status"] == status
        decision["fleet"] = fleet(usd_per_month).model_dump(mode="json")
        registry.register(str(model_dir), RegistryDecision.model_validate(decision))
    registry.promote(1)
    return settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Return settings over a seeded artifact store and registry."""
    return seed_store(tmp_path)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    """Return a client of the plugin app, with auth (Airflow's, tested elsewhere) allowed."""
    app = burstcv_views.app
    app.dependency_overrides[burstcv_views.settings_dep] = lambda: settings
    app.dependency_overrides[burstcv_views.require_dag_read] = lambda: None
    with TestClient(app) as test_client:
        yield test_client
    app.dependency_overrides.clear()


def test_safe_run_id_matches_the_pipeline_rule() -> None:
    from burstcv_spec.storage import safe_run_id

    for run_id in (RUN_ID, "asset_triggered__2026-01-01T00:00:00.123+00:00", "a/b\\c d"):
        assert burstcv_views.safe_run_id(run_id) == safe_run_id(run_id)
    assert burstcv_views.safe_run_id(RUN_ID) == RUN_KEY


def test_json_lists_versions_aliases_reasons_and_run_costs(client: TestClient) -> None:
    body = client.get("/api/models").json()
    assert body["aliases"] == {"production": 1, "previous": None}
    versions = {v["version"]: v for v in body["versions"]}
    assert versions[1]["status"] == "accepted" and versions[1]["aliases"] == [PRODUCTION]
    assert versions[1]["accuracy"] == 0.97 and versions[1]["p95_ms"] == 12.5
    assert versions[2]["status"] == "rejected"
    assert versions[2]["reasons"] == ["p95 71.0 ms > SLO 50.0 ms"]
    assert versions[2]["report_url"] == f"/burstcv/runs/{RUN_KEY}/report/index.html"
    (run,) = body["runs"]
    # Named as Airflow names it (run.json), kept under its folder's key.
    assert (run["run_id"], run["run_key"]) == (RUN_ID, RUN_KEY)
    assert run["cost_usd"] == 0.1234 and run["version"] == 2
    # The run as resolved (run.json): what started it, on which data, its boxes and budget.
    assert (run["trigger"], run["dataset_uri"], run["boxes"], run["max_cost_usd"]) == (
        "manual",
        "s3://bucket/digits/v7",
        2,
        5.0,
    )
    assert run["airflow_run_url"] == versions[1]["airflow_run_url"]
    # Each version's fleet, as the sizing chose it; version 2's had no price.
    assert versions[1]["fleet"]["usd_per_month"] == 195.46
    assert versions[2]["fleet"]["replicas"] == 3 and versions[2]["fleet"]["usd_per_month"] is None
    assert run["data_docs_url"] == f"/burstcv/runs/{RUN_KEY}/dataset/data_docs/index.html"
    assert versions[1]["airflow_run_url"] == (
        "/dags/burstcv_pipeline/runs/manual__2026-11-29T10%3A00%3A00%2B00%3A00"
    )


def test_page_shows_the_versions_and_costs_tables(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    page = response.text
    assert '<table id="versions">' in page and '<table id="runs">' in page
    assert "0.9700" in page and "12.50 ms" in page
    assert "p95 71.0 ms &gt; SLO 50.0 ms" in page
    # The run's row: what started it, on which data, its boxes, its bill of its budget.
    assert (
        "<td>manual</td><td>s3://bucket/digits/v7</td><td>ec2</td><td>2</td>"
        "<td>$0.1234 of $5.0000</td><td>2</td>"
    ) in page
    # Each version's fleet: priced, or unpriced (never an error, never $0).
    versions = page[page.index('<table id="versions">') : page.index('<table id="runs">')]
    curve = f'(<a href="runs/{RUN_KEY}/report/index.html#fleet">p95 against load</a>)'
    assert f"<td>3 x c7i.large, $195.46/month {curve}</td>" in versions
    assert f"<td>3 x c7i.large, unpriced {curve}</td>" in versions
    # Links are relative to the page, so they survive a proxy's path prefix.
    assert f'href="runs/{RUN_KEY}/report/index.html"' in page
    # Airflow's pages open at the top level, not inside the plugin's frame.
    airflow_links = re.findall(r'<a href="\.\./dags/[^"]+"([^>]*)>', page)
    assert airflow_links and all(attrs == ' target="_top"' for attrs in airflow_links)


def test_page_shows_the_alias_history_newest_first(client: TestClient, settings: Settings) -> None:
    registry = Registry(settings.registry_uri, settings.model_name)
    registry.promote(2, force=True, actor="cli:alice@box:41")
    with pytest.raises(AliasConflictError):
        registry.promote(1, expect=1, actor="run:<manual>")  # production holds 2 by now
    history = client.get("/api/models").json()["history"]
    assert [(h["actor"], h["alias"], h["from"], h["to"], h["result"]) for h in history] == [
        ("run:<manual>", PRODUCTION, 1, 1, "conflict"),
        ("cli:alice@box:41", "previous", None, 1, "moved"),
        ("cli:alice@box:41", PRODUCTION, 1, 2, "moved"),
        ("api", PRODUCTION, None, 1, "moved"),
    ]
    page = client.get("/").text
    table = page[page.index('<table id="history">') :]
    assert (
        table.index("run:&lt;manual&gt;")
        < table.index("cli:alice@box:41")
        < table.index("<td>api</td>")
    )
    assert "<td>1 → 2</td>" in table and "production holds version 2, not version 1" in table


def test_a_run_refused_before_it_was_resolved_shows_dashes(
    client: TestClient, settings: Settings
) -> None:
    # No run.json: the run was refused at its first task (unpriced, or a budget too small).
    refused = Path(settings.artifact_root) / "runs" / "manual__2026-11-29T11_00_00_00_00"
    (refused / "job").mkdir(parents=True)
    (refused / "job" / "billing.json").write_text(
        json.dumps(
            {
                "backend": "ec2",
                "billed_seconds": {},
                "cost_usd": 0.0,
                "instance_ids": [],
                "instances": [],
            }
        )
    )
    rows = {r["run_id"]: r for r in client.get("/api/models").json()["runs"]}
    row = rows["manual__2026-11-29T11_00_00_00_00"]
    assert (row["trigger"], row["dataset_uri"], row["boxes"], row["max_cost_usd"]) == (None,) * 4
    assert row["airflow_run_url"] is None
    page = client.get("/").text
    assert (
        "<td>manual__2026-11-29T11_00_00_00_00</td><td>–</td><td>–</td><td>ec2</td><td>–</td>"
        "<td>$0.0000 of –</td>"
    ) in page


def test_a_run_json_written_before_runs_were_resolved_does_not_break_the_page(
    client: TestClient, settings: Settings
) -> None:
    # An artifact store kept across the upgrade: this run's run.json has the old fields only.
    old = Path(settings.artifact_root) / "runs" / "manual__2026-11-28T10_00_00_00_00"
    old.mkdir(parents=True)
    (old / "run.json").write_text(
        json.dumps(
            {
                "run_id": "manual__2026-11-28T10:00:00+00:00",
                "dataset_uri": "/data/digits",
                "started_at": "2026-11-28T10:00:01+00:00",
            }
        )
    )
    response = client.get("/api/models")
    assert response.status_code == 200, response.text
    keys = {r["run_key"] for r in response.json()["runs"]}
    assert keys == {RUN_KEY, "manual__2026-11-28T10_00_00_00_00"}
    page = client.get("/")
    assert page.status_code == 200 and "<td>manual</td><td>s3://bucket/digits/v7</td>" in page.text


def test_page_of_an_empty_store_says_so(tmp_path: Path) -> None:
    empty = Settings(artifact_root=str(tmp_path / "a"), registry_uri=str(tmp_path / "r"))
    page = burstcv_views.render_page(burstcv_views.model_versions(empty), [])
    assert "no versions registered yet" in page and "no runs yet" in page
    assert "no alias moves recorded yet" in page


def test_artifacts_are_served_with_their_media_type(client: TestClient) -> None:
    docs = client.get(f"/runs/{RUN_KEY}/dataset/data_docs/index.html")
    assert docs.status_code == 200 and docs.text == "<html>data docs</html>"
    assert docs.headers["content-type"].startswith("text/html")
    css = client.get(f"/runs/{RUN_KEY}/dataset/data_docs/static/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert client.get(f"/runs/{RUN_KEY}/report/").text == "<html>run report</html>"
    assert client.get(f"/runs/{RUN_KEY}/report/missing.html").status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        f"/runs/{RUN_KEY}/report/..%2F..%2F..%2F..%2Fsecret.txt",
        f"/runs/{RUN_KEY}/report/%2e%2e/%2e%2e/%2e%2e/%2e%2e/secret.txt",
        "/runs/..%2F..%2F..%2F/report/secret.txt",
        f"/runs/{RUN_KEY}/report/%2Fetc%2Fpasswd",
        f"/runs/{RUN_KEY}/job/billing.json",  # only Data Docs and the report are browsable
        f"/runs/{RUN_KEY}/report/..%5C..%5Csecret.txt",
    ],
)
def test_path_traversal_is_refused(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "do not serve" not in response.text


def test_a_symlink_out_of_the_run_is_refused(client: TestClient, settings: Settings) -> None:
    report = Path(settings.artifact_root) / "runs" / RUN_KEY / "report"
    (report / "leak.txt").symlink_to(Path(settings.artifact_root).parent / "secret.txt")
    assert client.get(f"/runs/{RUN_KEY}/report/leak.txt").status_code == 404


def ti_key(task_id: str, run_id: str = RUN_ID, dag_id: str = "burstcv_pipeline") -> Any:
    """Return a stand-in for Airflow's TaskInstanceKey (the fields links read)."""
    return SimpleNamespace(dag_id=dag_id, task_id=task_id, run_id=run_id, map_index=-1)


def test_links_point_each_task_at_what_it_produced(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(burstcv_plugin, "get_settings", lambda: settings)
    docs, report, deployed = (
        burstcv_plugin.DataDocsLink(),
        burstcv_plugin.RunReportLink(),
        burstcv_plugin.DeployedModelLink(),
    )
    assert docs.get_link(None, ti_key=ti_key("validate")) == (
        f"/burstcv/runs/{RUN_KEY}/dataset/data_docs/index.html"
    )
    assert report.get_link(None, ti_key=ti_key("report")) == (
        f"/burstcv/runs/{RUN_KEY}/report/index.html"
    )
    assert deployed.get_link(None, ti_key=ti_key("deploy")) == "http://127.0.0.1:8123/v1/model"
    # Other tasks, other DAGs and runs without the page get no link (the UI hides '').
    assert docs.get_link(None, ti_key=ti_key("pack")) == ""
    assert docs.get_link(None, ti_key=ti_key("validate", dag_id="other")) == ""
    assert report.get_link(None, ti_key=ti_key("report", run_id="manual__never")) == ""
    no_service = settings.model_copy(update={"serving_url": ""})
    monkeypatch.setattr(burstcv_plugin, "get_settings", lambda: no_service)
    assert deployed.get_link(None, ti_key=ti_key("deploy")) == ""


def test_airflow_loads_the_plugin_cheaply() -> None:
    """Every Airflow process loads plugins: no torch, numpy or pandas, and no import errors."""
    code = (
        "import sys\n"
        "from airflow import plugins_manager as pm\n"
        "plugins, errors = pm._get_plugins()\n"
        "assert errors == {}, errors\n"
        "(plugin,) = [p for p in plugins if p.name == 'burstcv']\n"
        "links = sorted(link.name for link in pm.get_global_operator_extra_links())\n"
        "apps = [a['url_prefix'] for a in pm.get_fastapi_plugins()[0]]\n"
        "views = [v['url_route'] for v in pm._get_ui_plugins()[0]]\n"
        "heavy = [m for m in ('torch', 'numpy', 'pandas', 'onnxruntime') if m in sys.modules]\n"
        "print(links, apps, views, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        "['Data Docs', 'Deployed model', 'Run report'] ['/burstcv'] ['burstcv'] []"
    )


@pytest.mark.parametrize(
    ("run_key", "path"),
    [
        (RUN_KEY, "report/../../../../secret.txt"),
        (RUN_KEY, "/etc/passwd"),
        ("..", "report/x"),
        (RUN_KEY, "report/a//b"),
        (RUN_KEY, "report/./index.html"),
        ("a:b", "report/index.html"),
        (RUN_KEY, "job/billing.json"),
        (RUN_KEY, "dataset/manifest.parquet"),
    ],
)
def test_artifact_uri_rejects_anything_that_could_leave_the_tree(
    settings: Settings, run_key: str, path: str
) -> None:
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as raised:
        burstcv_views.artifact_uri(settings, run_key, path)
    assert raised.value.status_code == 404


# ---------------------------------------------------------------------------------------------
# Every link a user can follow from the plugin's pages and the task links resolves.

# External URLs the pages link on purpose: GX Data Docs' CDN assets and GX's own site (the
# pages say that styling needs internet), and the deployed service the deploy task links to.
EXTERNAL_ON_PURPOSE = (
    "https://unpkg.com/",
    "https://maxcdn.bootstrapcdn.com/",
    "https://stackpath.bootstrapcdn.com/",
    "https://cdnjs.cloudflare.com/",
    "https://cdn.jsdelivr.net/",
    "https://code.jquery.com/",
    "https://greatexpectations.io",
    "https://docs.greatexpectations.io/",
    "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/",
    "http://127.0.0.1:8123/v1/model",
)
_HREF = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
# Data Docs' tables link their rows from script data: {'_table_row_link_path': 'a/b.html'}.
_ROW_LINK = re.compile(r"""['"]_table_row_link_path['"]\s*:\s*['"]([^'"]+)['"]""")


def real_run_pages(settings: Settings, tmp_path: Path) -> None:
    """Replace the seeded run's pages with what validate and report really write."""
    from PIL import Image

    from burstcv.data.validate import ValidationConfig, validate_dataset
    from burstcv.report.render import build_report

    data = tmp_path / "pets"
    for split, per_class in (("train", 6), ("val", 5)):
        for c, label in enumerate(("cat", "dog")):
            (data / split / label).mkdir(parents=True)
            for i in range(per_class):
                color = (40 * i, 120 * c, 7 * i + (split == "val") * 90)
                Image.new("RGB", (16, 16), color).save(data / split / label / f"{i}.png")
    run = Path(settings.artifact_root) / "runs" / RUN_KEY
    shutil.rmtree(run / "dataset")
    report = validate_dataset(str(data), str(run / "dataset"), ValidationConfig(min_total_images=1))
    assert report.success, report.summary
    build_report(
        str(run),
        registry_uri=settings.registry_uri,
        model_name=settings.model_name,
        serving_url=settings.serving_url.split(",")[0],
    )


def test_every_link_on_the_pages_and_task_links_resolves(
    settings: Settings, client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from burstcv import links

    real_run_pages(settings, tmp_path)
    monkeypatch.setattr(burstcv_plugin, "get_settings", lambda: settings)
    start = [burstcv_views.URL_PREFIX + "/"]
    for link in burstcv_plugin.BurstcvPlugin.global_operator_extra_links:
        for task in ("validate", "report", "deploy"):
            if url := link.get_link(None, ti_key=ti_key(task)):
                start.append(url)
    assert len(start) == 4, start  # the page and three task links
    airflow_pages = {links.airflow_run_path(RUN_ID)}
    seen: set[str] = set()
    todo = list(start)
    external: set[str] = set()
    airflow_linked: set[str] = set()
    while todo:
        url = todo.pop()
        if url in seen:
            continue
        seen.add(url)
        if url.startswith(("http://", "https://")):
            assert url.startswith(EXTERNAL_ON_PURPOSE), f"unexpected external link {url}"
            external.add(url)
            continue
        if not url.startswith(burstcv_views.URL_PREFIX + "/"):
            # Airflow's own UI (one level above the plugin): only run pages are linked.
            assert url in airflow_pages, f"{url} is neither a plugin page nor an Airflow run"
            airflow_linked.add(url)
            continue
        response = client.get(url.removeprefix(burstcv_views.URL_PREFIX))
        assert response.status_code == 200, f"{url}: {response.status_code} {response.text}"
        if not response.headers["content-type"].startswith("text/html"):
            continue
        for target in _HREF.findall(response.text) + _ROW_LINK.findall(response.text):
            if target.startswith(("#", "data:", "mailto:", "javascript:")):
                continue
            todo.append(urljoin(url, target.split("#")[0]))
    walked = {u for u in seen if u.startswith(burstcv_views.URL_PREFIX)}
    docs_index = links.page_url(RUN_ID, "data-docs")
    assert docs_index in walked, "the report's (and the task's) Data Docs link was followed"
    assert any("/validations/" in u for u in walked), "the Data Docs' validation page too"
    assert links.page_url(RUN_ID, "report") in walked
    assert airflow_linked == airflow_pages
    assert "http://127.0.0.1:8123/v1/model" in external


def test_data_docs_say_that_their_styling_needs_internet(
    settings: Settings, client: TestClient, tmp_path: Path
) -> None:
    from burstcv.data.suite import CDN_NOTICE

    real_run_pages(settings, tmp_path)
    index = client.get(f"/runs/{RUN_KEY}/dataset/data_docs/index.html").text
    assert "https://maxcdn.bootstrapcdn.com/" in index  # GX's pages do load CDN assets...
    # ...and say so at the top, hidden once Bootstrap has loaded
    assert CDN_NOTICE.removesuffix("</div>") in index
    assert index.index(CDN_NOTICE.removesuffix("</div>")) < index.index("</body>")
    assert 'class="d-none burstcv-offline-note"' in CDN_NOTICE
    # Offline, GX's own table of validation pages stays empty: the notice links each of them,
    # and each link opens the page.
    notice = index[index.index("burstcv-offline-note") :].split("</div>")[0]
    pages = re.findall(r'<a href="(validations/[^"]+\.html)">', notice)
    assert pages, notice
    for page in pages:
        opened = client.get(f"/runs/{RUN_KEY}/dataset/data_docs/{page}")
        assert opened.status_code == 200 and "Validation" in opened.text


def test_the_models_page_renders_in_headless_chromium(settings: Settings, tmp_path: Path) -> None:
    import numpy as np
    from PIL import Image

    skipped = Path(settings.artifact_root) / "runs" / "scheduled__2026-11-30T00_00_00_00_00"
    skipped.mkdir(parents=True)
    write_run_json(
        skipped,
        "scheduled__2026-11-30T00:00:00+00:00",
        trigger="scheduled",
        dataset_uri="/data/digits",
        boxes=1,
        max_cost_usd=2.5,
    )
    reason = "nothing new to train on: the validated dataset ... of production version 1"
    skip = {"reason": reason, "production_version": 1, "fingerprint": "f1", "decided_at": "now"}
    (skipped / "skip.json").write_text(json.dumps(skip))
    page = tmp_path / "models.html"
    page.write_text(
        burstcv_views.render_page(
            burstcv_views.model_versions(settings), burstcv_views.run_costs(settings)
        )
    )
    shot = tmp_path / "models.png"
    said = chromium_screenshot(page.as_uri(), shot, 1200, 700)
    if said is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    assert shot.is_file(), f"no screenshot; chromium said:\n{said[-3000:]}"
    with Image.open(shot) as img:
        pixels = np.asarray(img.convert("RGB"))
    assert pixels.shape == (700, 1200, 3)
    # Drawn, not blank: text in the status colours (accepted green, rejected red) and links.
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7].tolist()}
    assert len(colours) > 50
    html_text = page.read_text()
    assert reason in html_text and "$0.1234 of $5.0000" in html_text
    assert "<td>scheduled</td><td>/data/digits</td><td>–</td><td>1</td>" in html_text
    assert "$0 (skipped) of $2.5000" in html_text
    assert "3 x c7i.large, unpriced" in html_text
    if target := os.environ.get("BURSTCV_MODELS_SCREENSHOT"):
        shutil.copy(shot, target)


def test_a_fleet_says_whose_sizes_it_rests_on_and_when_the_generator_was_the_limit(
    settings: Settings, tmp_path: Path
) -> None:
    registry = Registry(settings.registry_uri, settings.model_name)
    for run_id, measured_in, bound in (
        ("manual__reused", RUN_ID, False),  # an earlier version's run measured its sizes
        ("manual__gone", "manual__pruned", True),  # a run no registered version comes from
    ):
        model_dir = write_model_dir(tmp_path / run_id, f"onnx of {run_id}".encode(), run_id=run_id)
        decision = gate_decision(0.97, 12.5, [])
        decision["fleet"] = (
            fleet(195.46).model_copy(update={"generator_bound": bound}).model_dump(mode="json")
        )
        decision["fleet_measured_in"] = measured_in
        registry.register(str(model_dir), RegistryDecision.model_validate(decision))
    app = burstcv_views.app
    app.dependency_overrides[burstcv_views.settings_dep] = lambda: settings
    app.dependency_overrides[burstcv_views.require_dag_read] = lambda: None
    try:
        with TestClient(app) as client:
            page = client.get("/").text
            versions = client.get("/api/models").json()["versions"]
    finally:
        app.dependency_overrides.clear()
    assert versions[0]["fleet_measured_in"] == "manual__pruned"
    # Versions 1 and 2 come from RUN_ID: the newest of them is named.
    # Each links to the sizes it rests on: each size's p95 against load, in that run's report.
    curve = '(<a href="runs/{}/report/index.html#fleet">p95 against load</a>)'
    ours = curve.format(RUN_KEY)
    assert f"<td>3 x c7i.large, $195.46/month (sizes of v2) {ours}</td>" in page
    assert (
        "<td>3 x c7i.large, $195.46/month (at most: the load generator was the limit) "
        f"(sizes of run manual__pruned) {curve.format('manual__pruned')}</td>"
    ) in page
    # A version that measured its own sizes says nothing more.
    assert f"<td>3 x c7i.large, $195.46/month {ours}</td>" in page
