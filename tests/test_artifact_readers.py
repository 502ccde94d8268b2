"""Artifacts are read through their contracts: no module outside ``burstcv_spec`` parses one.

A JSON file a stage writes has one type in ``burstcv_spec.contracts``; its readers call
``read_artifact`` (or the model's own ``model_validate``) and get that type, never a dict to
``.get("...")`` from. Renaming a field then fails mypy and the tests where it is read, not the
report at run time. The walk is ``ast`` over the source, importing nothing: a call to
``read_json`` outside ``burstcv_spec`` is refused, and so is ``json.loads`` except in the
places below, each of which parses something that is not a run artifact.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = (
    REPO / "src" / "burstcv",
    REPO / "serving" / "burstcv_serving",
    REPO / "plugins",
    REPO / "dags",
)

# Where json.loads may parse text, and what that text is.
PARSES_OTHER_JSON: dict[str, str] = {
    "src/burstcv/cli.py": "the --conf option of `burstcv run`: run params typed by a user",
    "src/burstcv/compute/ec2.py": "STS DecodeAuthorizationMessage's answer, to name a refusal",
    "src/burstcv/cost/pricing.py": "the bundled price table and the Price List API's answers",
    "src/burstcv/registry/registry.py": "an alias file (then parse_artifact) and a lock's body",
    "src/burstcv/stack.py": "Airflow's simple auth manager passwords file ({user: password})",
    "src/burstcv/training/train.py": "checkpoint fields (then model_validate) and a job.json "
    "too broken to validate, read only for where to write its FAILED marker",
}
# Where read_json may be called outside burstcv_spec, and which model reads the result.
READS_THROUGH_OWN_MODEL: dict[str, str] = {
    "src/burstcv/training/job.py": "job.json, through JobSpec (load_job)",
    "src/burstcv/training/train.py": "a job.json too broken for JobSpec (see above)",
}


def _called(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return f"{owner}.{func.attr}" if owner else func.attr
    return func.id if isinstance(func, ast.Name) else ""


def calls(name: str, roots: tuple[Path, ...] = ROOTS, base: Path = REPO) -> set[str]:
    """Return the source files (relative to ``base``) that call ``name``."""
    found = set()
    for root in roots:
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                called = _called(node)
                if called.split(".")[-1] == name and (name != "loads" or called == "json.loads"):
                    found.add(path.relative_to(base).as_posix())
    return found


def test_no_module_outside_the_contracts_reads_an_artifact_as_json() -> None:
    assert calls("read_json") == set(READS_THROUGH_OWN_MODEL), (
        "read an artifact with burstcv_spec.contracts.read_artifact and its contract"
    )


def test_json_is_parsed_only_where_it_is_not_a_run_artifact() -> None:
    assert calls("loads") == set(PARSES_OTHER_JSON), (
        "a new JSON file is a contract (burstcv_spec.contracts), read with read_artifact"
    )


def test_the_check_sees_a_reader_that_breaks_the_rule(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "reader.py").write_text(
        "import json\nfrom burstcv_spec import storage\n\n\ndef f(uri):\n"
        "    return storage.read_json(uri), json.loads(open(uri).read())\n"
    )
    (package / "fine.py").write_text("import json\n\nprint(json.dumps({}))\n")
    assert calls("read_json", (package,), tmp_path) == {"pkg/reader.py"}
    assert calls("loads", (package,), tmp_path) == {"pkg/reader.py"}
