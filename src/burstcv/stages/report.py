"""Write a run's one-page HTML report."""

from __future__ import annotations

from burstcv.settings import Settings, get_settings
from burstcv.stages.resolve import run_layout
from burstcv_spec.contracts import RunRef


def report(run: RunRef, settings: Settings | None = None) -> str:
    """Write runs/<id>/report/index.html: one self-contained page about this run."""
    from burstcv.report.render import build_report

    s = settings or get_settings()
    return build_report(
        run_layout(run, s).root,
        registry_uri=s.registry_uri,
        model_name=s.model_name,
        serving_url=s.serving_url.split(",")[0].strip(),
    )
