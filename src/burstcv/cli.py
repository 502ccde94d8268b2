"""Offer one command-line verb per stage: exit 0 on success, non-zero with a one-line reason."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

from burstcv import lineage
from burstcv.cli_options import run_options
from burstcv.params import DATA_CHECKS, EXPORT_PARAMS, RunParams, run_fields
from burstcv.settings import Settings, get_settings

if TYPE_CHECKING:
    from burstcv_spec.contracts import Deployed, SizingReport

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
log = logging.getLogger("burstcv")

# Third-party loggers whose INFO lines (which would bury burstcv's answer) only `-v` shows.
QUIET_NAMESPACES = ("airflow", "sqlalchemy", "alembic", "botocore", "py.warnings")
_VERBOSE = {"on": False}


@app.callback()
def _main(
    ctx: typer.Context,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="show third-party INFO logs (Airflow's, boto's)"),
    ] = False,
) -> None:
    """burstcv: train on ephemeral GPUs, serve on right-sized CPUs."""
    _VERBOSE["on"] = verbose
    # `run` sends everything to its log file instead, Airflow's INFO lines included.
    if not verbose and ctx.invoked_subcommand != "run":
        # Before Airflow is imported: its logging config reads this (a user's own value wins).
        levels = " ".join(f"{name}=WARNING" for name in QUIET_NAMESPACES)
        os.environ.setdefault("AIRFLOW__LOGGING__NAMESPACE_LEVELS", levels)
        for name in QUIET_NAMESPACES:
            logging.getLogger(name).setLevel(logging.WARNING)


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _run_params(given: dict[str, Any], settings: Settings, code: int = 1) -> RunParams:
    """Return the run's parameters, or exit with the one-line reason they are refused."""
    try:
        return RunParams.resolve(given, settings)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'run parameters'}: {e['msg']}" for e in exc.errors()
        )
        raise _fail(f"invalid run parameters: {reasons}", code) from None
    except ValueError as exc:
        raise _fail(str(exc), code) from None


@app.command("demo-data")
def demo_data(
    directory: Annotated[Path, typer.Argument(help="where to write the dataset")],
) -> None:
    """Write scikit-learn's 1,797 handwritten digits as 32x32 RGB PNGs (ImageFolder)."""
    from burstcv.data.demo import write_demo_dataset

    _setup_logging()
    counts = write_demo_dataset(directory)
    typer.echo(f"wrote {sum(counts.values())} images to {directory} ({counts})")


@app.command()
@run_options(("expected_classes", *DATA_CHECKS))
def validate(
    dataset: Annotated[str, typer.Argument(help="dataset root: a folder or s3://bucket/prefix")],
    run_id: Annotated[
        str, typer.Option(help="the run whose folder holds the evidence (default: a new cli__ run)")
    ] = "",
    *,
    given: dict[str, Any],
) -> None:
    """Check a dataset with the pipeline's validate stage: exit 0 pass, 1 failed check, 2 unusable.

    The evidence goes to the run's dataset folder; a pass is the next run's drift baseline.
    """
    from burstcv.data.manifest import DatasetUnusableError
    from burstcv.stages.data import validate as validate_dataset
    from burstcv.stages.resolve import ValidationFailed
    from burstcv_spec.contracts import RunRef

    _setup_logging()
    settings = get_settings()
    params = _run_params({**given, "dataset_uri": dataset}, settings, code=2)
    run = run_id or f"cli__{lineage.utc_now_iso()}"
    try:
        validated = validate_dataset(RunRef.of(run), settings, params=params)
    except ValidationFailed as exc:
        if isinstance(exc.__cause__, DatasetUnusableError):
            raise _fail(str(exc), 2) from None
        typer.echo(str(exc))
        raise typer.Exit(1) from None
    typer.echo(
        f"passed: {dataset} (run {run})\nvalidation.json: {validated.validation_uri}\n"
        f"Data Docs: {validated.data_docs_uri}"
    )


@app.command()
def train(
    job: Annotated[str, typer.Option("--job", help="URI of job.json")],
    attempt: Annotated[int, typer.Option("--attempt", min=1, help="attempt number")] = 1,
) -> None:
    """Run a training job (what every training box runs, and nothing else)."""
    from burstcv.training.entry import train as train_job

    _setup_logging()
    try:
        code = train_job(job, attempt)
    except Exception as exc:  # FAILED was written; print the reason in one line
        raise _fail(f"training failed: {type(exc).__name__}: {exc}") from None
    raise typer.Exit(code)


@app.command()
def preflight(
    job: Annotated[str, typer.Option("--job", help="URI of job.json")],
    attempt: Annotated[int, typer.Option("--attempt", min=1, help="attempt number")] = 1,
    instance_type: Annotated[str, typer.Option(help="EC2 type, for the GPU count")] = "",
) -> None:
    """Check Python, torch, CUDA, the driver and the GPU count before a box trains."""
    from burstcv.training.entry import preflight as run_preflight

    _setup_logging()
    raise typer.Exit(run_preflight(job, attempt, instance_type))


@app.command()
@run_options(EXPORT_PARAMS)
def export(
    run_id: Annotated[str, typer.Argument(help="the run whose trained model to export")],
    *,
    given: dict[str, Any],
) -> None:
    """Export a run's trained model as the pipeline's export stage does (ONNX, parity, INT8)."""
    from burstcv.export.onnx_export import CheckpointError, ParityError
    from burstcv.stages.export import export as export_model
    from burstcv.stages.resolve import StageError, run_layout
    from burstcv_spec import storage
    from burstcv_spec.contracts import ArtifactError, RunRef

    _setup_logging()
    settings = get_settings()
    paths = run_layout(run_id, settings)
    if not storage.exists(paths.metrics):
        raise _fail(f"run {run_id} has no trained model: {paths.metrics} does not exist")
    try:
        exported = export_model(RunRef.of(run_id), settings, overrides=given)
    except (ValidationError, ValueError) as exc:
        raise _fail(f"invalid export options: {exc}".splitlines()[0]) from None
    except (CheckpointError, ParityError, ArtifactError, StageError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(
        f"exported {exported.model_dir}/{exported.onnx_file} sha256={exported.sha256} "
        f"(parity max |diff| {exported.parity_max_abs_diff:.2e})"
    )
    if exported.quantization:
        typer.echo(exported.quantization.reason)


@app.command()
def serve() -> None:
    """Run the prediction service in the foreground (settings: BURSTCV_SERVING_*)."""
    os.execv(sys.executable, [sys.executable, "-m", "burstcv_serving"])


@app.command()
def predict(
    image: Annotated[Path, typer.Argument(help="an image file (PNG, JPEG, WebP)")],
    url: Annotated[
        str, typer.Option(help="base URL of the prediction service")
    ] = "http://127.0.0.1:8000",
) -> None:
    """Send one image to the prediction service and print its answer."""
    import httpx

    try:
        response = httpx.post(
            f"{url}/v1/predict", files={"file": (image.name, image.read_bytes())}, timeout=30
        )
    except (OSError, httpx.HTTPError) as exc:
        raise _fail(f"could not reach {url}: {exc}") from None
    if response.status_code != 200:
        raise _fail(f"{response.status_code}: {response.text}")
    body = response.json()
    top = body["predictions"][0]
    typer.echo(
        f"{image.name}: {top['label']} (score {top['score']:.3f}) from model "
        f"{body.get('model', '')} version {body['version']}"
    )
    typer.echo(json.dumps(body, indent=2, sort_keys=True, default=str))


def _cli_actor() -> str:
    """Name who moves an alias from the command line, for the registry's history."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container's anonymous uid)
        user = f"uid{os.getuid()}"
    # The pid tells two commands by one operator apart in the history.
    return f"cli:{user}@{socket.gethostname()}:{os.getpid()}"


@app.command()
def models(
    history: Annotated[
        bool, typer.Option("--history", help="show the alias history (who moved what, when)")
    ] = False,
    limit: Annotated[int, typer.Option(help="newest history events to show")] = 50,
) -> None:
    """List the registered versions with their status, figures and aliases."""
    from burstcv.registry.registry import PREVIOUS, PRODUCTION, Registry, RegistryError
    from burstcv_spec.contracts import ArtifactError

    s = get_settings()
    registry = Registry(s.registry_uri, s.model_name)
    if history:
        try:
            events = registry.history(limit=limit)
        except RegistryError as exc:
            raise _fail(str(exc)) from None
        if not events:
            typer.echo(f"no alias moves recorded for {s.model_name} in {s.registry_uri}")
            return
        typer.echo(
            f"{'at':<27} {'actor':<24} {'action':<8} {'alias':<10} {'from':>4} {'to':>4}  "
            "result    detail"
        )
        for event in events:
            moved = ["-" if v is None else v for v in (event.from_version, event.to_version)]
            typer.echo(
                f"{event.at:<27} {event.actor:<24} {event.action:<8} {event.alias:<10} "
                f"{moved[0]:>4} {moved[1]:>4}  {event.result:<9} {event.detail}".rstrip()
            )
        return
    aliases = {name: registry.get_alias(name) for name in (PRODUCTION, PREVIOUS)}
    rows = registry.versions()
    if not rows:
        typer.echo(f"no versions of {s.model_name} in {s.registry_uri}")
        return
    typer.echo(f"{'version':>7}  {'status':<9} {'alias':<11} {'accuracy':>8} {'p95 ms':>8}  run")
    for version in rows:
        try:
            entry = registry.entry(version)
        except ArtifactError as exc:
            raise _fail(str(exc)) from None
        cand = (entry.benchmark or {}).get("candidate")
        alias = ",".join(n for n, a in aliases.items() if a and a.version == version) or "-"
        acc = cand.accuracy if cand else None
        p95 = cand.p95_ms if cand else None
        typer.echo(
            f"{version:>7}  {entry.status:<9} {alias:<11} "
            f"{(f'{acc:.4f}' if acc is not None else '-'):>8} {(f'{p95:.2f}' if p95 else '-'):>8}  "
            f"{entry.lineage.run_id}"
        )


@app.command()
@run_options(("latency_slo_ms", "target_rps", "serving_families"))
def size(
    version: Annotated[int, typer.Argument(help="registered version to size")],
    images: Annotated[
        Path, typer.Option(help="a folder of images to send (a validation split, say)")
    ],
    region: Annotated[
        str, typer.Option(help="where the fleet is priced (default: BURSTCV_EC2_REGION)")
    ] = "",
    step_s: Annotated[
        float | None, typer.Option(help="seconds of load per rate (default BURSTCV_SIZING_STEP_S)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="also write the report (JSON) here")] = None,
    *,
    given: dict[str, Any],
) -> None:
    """Measure a version's sustainable rate per CPU size and print the cheapest fleet.

    Options and prices default as a run's (prices: AWS, else the bundled table).
    """
    import tempfile

    from burstcv.cost.budget import price_sources, serving_quotes
    from burstcv.gate.sizing import size_model
    from burstcv.registry.registry import Registry
    from burstcv_spec.contracts import write_artifact
    from burstcv_spec.storage import download_file, list_files

    _setup_logging()
    s = get_settings()
    params = _run_params(given, s)
    region = region or s.ec2.region
    registry = Registry(s.registry_uri, s.model_name)
    if version not in registry.versions():
        raise _fail(f"no version {version} of {s.model_name} in {s.registry_uri}")
    bodies = [
        p.read_bytes()
        for p in sorted(images.rglob("*"))
        if p.suffix.lower() in {".png", ".jpg", ".jpeg", ".webp"}
    ][:256]
    if not bodies:
        raise _fail(f"no PNG, JPEG or WebP image under {images}")
    families = list(params.serving_families)
    prices, unpriced = serving_quotes(families, region, price_sources(params, s))
    with tempfile.TemporaryDirectory(prefix="burstcv-size-") as tmp:
        prefix = registry.version_uri(version)
        for uri in list_files(prefix):
            download_file(uri, Path(tmp) / uri[len(prefix) :].lstrip("/"))
        report = size_model(
            tmp,
            bodies,
            latency_slo_ms=params.latency_slo_ms,
            target_rps=params.target_rps,
            prices=prices,
            region=region,
            unpriced=unpriced,
            max_vcpus=s.sizing_max_vcpus or None,
            duration_s=step_s or s.sizing_step_s,
            families=families,
        )
    _echo_sizing(report)
    if out is not None:
        write_artifact(str(out), report)
    if report.chosen is None:
        raise typer.Exit(1)


def _echo_sizing(report: SizingReport) -> None:
    """Print each size's sustainable rate, each fleet option and the verdict."""
    from burstcv.gate.sizing import describe_generator

    typer.echo(
        f"{'vCPUs':>5} {'req/s at SLO':>12} {'p95 ms':>8} {'CPU ms/req':>10}  load generator"
    )
    for point in report.sizes:
        cpu = f"{point.cpu_s_per_request * 1000:.2f}" if point.cpu_s_per_request else "-"
        p95 = f"{point.p95_ms:.2f}" if point.p95_ms is not None else "-"
        typer.echo(
            f"{point.vcpus:>5} {point.sustainable_rps:>12.1f} {p95:>8} {cpu:>10}  "
            f"{describe_generator(point)}"
        )
        if point.anomaly:
            typer.echo(f"      {point.anomaly}")
    for option in report.options:
        price = (
            f"${option.usd_per_month:>9,.2f}/month  ${option.usd_per_million:.4f}/1M"
            if option.usd_per_month is not None and option.usd_per_million is not None
            else "unpriced"
        )
        typer.echo(
            f"{option.replicas} x {option.instance_type:<12} {price}"
            f"{'  (extrapolated)' if option.extrapolated else ''}"
            f"{'  (at least: the load generator ceiling)' if option.generator_bound else ''}"
        )
    typer.echo(report.reason)


@app.command()
def promote(
    version: Annotated[int, typer.Argument(help="registered version to serve")],
    force: Annotated[bool, typer.Option(help="promote even if the gate rejected it")] = False,
) -> None:
    """Stage a version on the services, then point production at it (gate-accepted unless --force).

    Production moves only once every service has warmed it; else exit 1 with the refusal.
    """
    from burstcv.registry.deploy import deploy

    _move_production(lambda registry, **how: deploy(registry, version, force=force, **how))


@app.command()
def rollback() -> None:
    """Point production back at the previous version (staged on the services first)."""
    from burstcv.registry.deploy import rollback as rollback_deploy

    _move_production(rollback_deploy)


def _move_production(move: Callable[..., Deployed]) -> None:
    """Move production as ``move`` says (staged on the services); print where it points now."""
    from burstcv.registry.deploy import DeployError
    from burstcv.registry.registry import Registry, RegistryError, RejectedVersionError

    _setup_logging()
    s = get_settings()
    try:
        result = move(
            Registry(s.registry_uri, s.model_name),
            service_urls=[u.strip().rstrip("/") for u in s.serving_url.split(",") if u.strip()],
            token=s.serving_admin_token,
            timeout_s=s.deploy_verify_timeout_s,
            actor=_cli_actor(),
        )
    except RejectedVersionError as exc:  # only an unforced promote
        raise _fail(f"{exc} (use --force)") from None
    except (RegistryError, DeployError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"production -> version {result.version} (was {result.previous_version})")


@app.command()
def reap(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="only say what would be terminated")
    ] = False,
    backend: Annotated[str, typer.Option(help="comma-separated backends (default: settings)")] = "",
) -> None:
    """Terminate burstcv boxes whose expiry passed or whose DAG run is no longer running."""
    from burstcv.airflow.local_run import use_embedded_airflow
    from burstcv.compute.reaper import reap_errors, reap_everywhere

    _setup_logging()
    use_embedded_airflow()
    from burstcv.airflow.runs import run_activity_db

    settings = get_settings()
    names = [b.strip() for b in (backend or settings.reaper_backends).split(",") if b.strip()]
    reports = reap_everywhere(names, run_activity_db, dry_run=dry_run, settings=settings)
    for report in reports:
        verb = "would terminate" if dry_run else "terminated"
        where = f"{report.backend} {report.region}".strip()
        ids = report.instance_ids
        typer.echo(f"{where}: {verb} {len(ids)} {ids}; kept {len(report.kept)}")
        for error in report.errors:
            typer.echo(f"{where}: error: {error.step} {error.instance_id}: {error.error}", err=True)
        for warning in report.warnings:
            typer.echo(f"{where}: warning: {warning}", err=True)
    if errors := reap_errors(reports):
        # Every other box was still handled; a non-zero exit makes the failure visible.
        raise _fail(f"reaper: {errors} error(s) in this pass (see above)")


aws_app = typer.Typer(no_args_is_help=True, help="Check the AWS account burstcv runs in.")
app.add_typer(aws_app, name="aws")


@aws_app.command("check")
@run_options(("num_nodes", "serving_families"))
def aws_check(*, given: dict[str, Any]) -> None:
    """Check the account a first EC2 run needs, renting nothing; print what is missing.

    Launches and the backstop are dry runs; quotas are sized for --num-nodes (docs/aws.md).
    """
    from burstcv.airflow.local_run import use_embedded_airflow

    # The AWS connection is Airflow's: the embedded one's, never a new ~/airflow.
    use_embedded_airflow()
    from burstcv.compute.awscheck import check_account

    _setup_logging()
    settings = get_settings()
    params = _run_params(given, settings)
    try:
        findings = check_account(
            settings,
            num_nodes=params.num_nodes,
            serving_families=list(params.serving_families),
        )
    except ValueError as exc:  # settings that cannot even be read
        raise _fail(str(exc)) from None
    for finding in findings:
        typer.echo(finding.line())
    missing = [f for f in findings if not f.ok]
    if missing:
        raise _fail(f"{len(missing)} of {len(findings)} checks failed; see docs/aws.md")
    typer.echo(f"all {len(findings)} checks passed: nothing was rented")


@app.command()
def home(
    paths: Annotated[bool, typer.Option("--paths", help="also list the folders in it")] = False,
) -> None:
    """Print the burstcv home (BURSTCV_HOME): the folder every local default lives in."""
    settings = get_settings()
    typer.echo(settings.home)
    if paths:
        for name in ("artifact_root", "registry_uri", "dataset_uri", "compute_state_dir"):
            typer.echo(f"{name} {getattr(settings, name)}")


@app.command("check-stack")
def check_stack() -> None:
    """Refuse a compose stack's weak secrets or incomplete EC2 settings (airflow-init runs it)."""
    from burstcv.stack import GENERATE, stack_problems

    if problems := stack_problems():
        for problem in problems:
            typer.echo(f"stack settings: {problem}", err=True)
        raise _fail(f"{len(problems)} problem(s) with the stack's settings; {GENERATE}")
    typer.echo("stack settings: secrets and backend settings are complete")


@app.command("stack-passwords")
def stack_passwords(
    path: Annotated[Path, typer.Argument(help="the simple auth manager's passwords file")],
) -> None:
    """Write a compose stack's Airflow UI passwords (the first user's: AIRFLOW_ADMIN_PASSWORD)."""
    from burstcv.stack import write_passwords

    try:
        names = write_passwords(path)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"passwords of {', '.join(names)} written to {path}")


@app.command("airflow-init")
def airflow_init() -> None:
    """Prepare the Airflow metadata DB for burstcv (run after `airflow db migrate`)."""
    from burstcv.airflow.local_run import use_embedded_airflow
    from burstcv.airflow.setup import ensure_pools

    _setup_logging()
    use_embedded_airflow()
    ensure_pools()
    typer.echo("burstcv Airflow setup done")


@app.command()
@run_options(run_fields())
def run(
    conf: Annotated[
        str, typer.Option(help="run parameters as JSON (the trigger form's fields); options win")
    ] = "{}",
    *,
    given: dict[str, Any],
) -> None:
    """Run the burstcv_pipeline DAG once, locally, with Airflow's dag.test().

    The tasks' logs go to a file whose path is printed (``burstcv -v run``: to the terminal).
    """
    from burstcv.airflow.local_run import run_pipeline_once

    _setup_logging()
    log_path = None if _VERBOSE["on"] else Path(get_settings().home) / "run" / "last-run.log"
    try:
        with _output_to(log_path):
            state, summary = run_pipeline_once({**json.loads(conf), **given})
    except (ValueError, RuntimeError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(summary)
    if log_path is not None:
        for reason in _failure_reasons(log_path):
            typer.echo(f"  failed: {reason}")
        typer.echo(f"  full log: {log_path} (or run burstcv -v run to see it as it happens)")
    if state != "success":
        raise typer.Exit(1)


@contextlib.contextmanager
def _output_to(path: Path | None) -> Iterator[None]:
    """Send this process's stdout and stderr (its subprocesses' too) to ``path`` meanwhile."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    try:
        with open(path, "wb") as sink:
            for fd in saved:
                os.dup2(sink.fileno(), fd)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def _failure_reasons(log_path: Path) -> list[str]:
    """Return each task's one-line failure reason the run logged (burstcv.airflow.callbacks)."""
    from burstcv.airflow.callbacks import FAILURE_MARKER as marker

    reasons = (
        line.split(marker, 1)[1].split(" [burstcv.airflow]")[0].strip()
        for line in log_path.read_text(errors="replace").splitlines()
        if marker in line and "no exception recorded" not in line
    )
    return list(dict.fromkeys(reasons))  # each once, in the order logged


if __name__ == "__main__":
    app()
