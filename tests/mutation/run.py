"""Mutation testing of the modules that decide: `make mutation` (not part of `make test`).

Each mutant is one small, deliberate bug (a comparison flipped, `and`/`or` swapped, a `not`
dropped, a number nudged, a `min` made `max`, a returned value dropped) in a function of a
decision module, or in a number of one of its module-level tables. The module's own tests run
against it; a mutant that no test notices *survived*, and is printed with its line.

How it runs: one process imports the tests once, records which test calls which function of
the module (with its duration), then forks a child per mutant. The child swaps the mutated
function's code object into the live function (every reference the tests hold sees it), or
re-executes the mutated table assignment, and runs only the tests that call that function,
fastest first, stopping at the first failure. Two children run at a time; a child that runs
past its time limit is killed and counts as caught (a mutant that hangs is noticed).

Usage: python tests/mutation/run.py [TARGET ...] [--list] [--jobs N]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Target:
    """One decision module, whole (every function, and the tables named), and its own tests."""

    name: str
    module: str
    tests: tuple[str, ...]
    tables: tuple[str, ...] = ()  # module-level names whose numbers are mutated
    # Mutants at once, at most: 1 for tests that measure how busy the host is (two children
    # would each read the other's work as a neighbour's).
    jobs: int | None = None

    def equivalent(self, m: Mutant) -> str:
        """Return why ``m`` is an equivalent mutant (no test can tell it apart), or ""."""
        for function, what, fragment, why in EQUIVALENT.get(self.name, ()):
            if (m.function, m.what) == (function, what) and fragment in m.source_line:
                return why
        return ""


# Survivors that no test can tell apart from the original: (function, mutation, a fragment of
# the line, why). They are listed apart and not counted in the score.
_TRUTHY = "its callers test the result's truth; None and False read alike"
_START = "where a search starts: it climbs or steps down from any start to the same bracket"
_WARM_UP = "the warm-up's load: no figure is read from it"
_DIGITS = "the digits a reported figure is rounded to"
_FLOAT_EDGE = "a rate stepped by 1.5x lands exactly on the bound only by float accident"
_NO_ANSWER = "the steps table's stand-in for a p95 that never came: past every SLO either way"
_JSON = "JSON layout only; every reader parses it the same"
EQUIVALENT: dict[str, tuple[tuple[str, str, str, str], ...]] = {
    "gate": (
        ("_price", "cmp0: <= -> <", "throughput_rps <= 0", "`not throughput_rps` refuses 0"),
        (
            "_Advice.throughput_at",
            "1e-06 -> 1.5e-06",
            "1e-6)",
            "a divide-by-zero guard; no p95 is that small",
        ),
        ("advise", "0.0 -> 1.0", "or 0.0", "sort key of unpriced advice, after priced either way"),
    ),
    "registry": (
        ("Registry._claim_version", "1000 -> 1001", "range(1000)", "retry bound, never reached"),
        ("Registry._try_claim", "return value dropped (None)", "return False", _TRUTHY),
        ("Registry._s3_lease", "cmp0: > -> >=", "> S3_LEASE_S", "a float clock never equals it"),
        ("Registry._s3_lease", "0 -> 1", 'get("at", 0)', "a lock with no time is stale either way"),
        ("Registry._s3_lease", "cmp0: > -> >=", "> deadline", "a float clock never equals it"),
        ("Registry._s3_lease", "0.05 -> 0.07500000000000001", "sleep(0.05)", "poll interval"),
        ("Registry.record", "8 -> 9", "hex[:8]", "length of a random file-name suffix"),
        ("_monotonic_ns", "1 -> 2", "_last_ns + 1", "still strictly increasing"),
        ("_conditional_write", "True -> False", "by_alias=True", "AliasRecord has no aliases"),
        ("_conditional_write", "2 -> 3", "indent=2", _JSON),
        ("_conditional_write", "True -> False", "sort_keys=True", _JSON),
        ("_s3_conditional", "return value dropped (None)", "return False", _TRUTHY),
    ),
    "deploy": (
        (
            "stage_everywhere",
            "True -> False",
            "cancel_futures=True",
            "every call has its own worker: nothing is ever queued to cancel",
        ),
    ),
    "admission": (
        ("AdmissionGate._can_admit", "return value dropped (None)", "return False", _TRUTHY),
        (
            "AdmissionGate._adjust",
            "2 -> 3",
            "self._slots / 2",
            "the halving floor never binds: the average moves 30% toward each window",
        ),
        (
            "AdmissionGate._fill",
            "cmp0: > -> >=",
            "arrived > waiting",
            "differs only for two arrivals at the same perf_counter reading",
        ),
        ("AdmissionGate._arm", "0.001 -> 0.0015", "0.001)", "shortest delay of an overdue sweep"),
    ),
    "preflight": (
        ("check_python", "2 -> 3", "version[:2]", "a 3-part version compares the same"),
        ("check_torch_version", "2 -> 3", "[:2]", "a 3-part version compares the same"),
        ("nvidia_driver_version", "30 -> 31", "timeout=30", "the time nvidia-smi is given"),
    ),
    "reaper": (("_no_credentials", "return value dropped (None)", "return False", _TRUTHY),),
    "recipe": (
        ("_pow2_floor", "0 -> 1", "max(0,", "below 2 it gives 1 or 2; MIN_BATCH (8) floors both"),
        ("_pow2_floor", "1.0 -> 1.5", "max(1.0,", "log2 of 1 to 1.5 floors to 0 alike"),
    ),
    "sizing": (
        ("LoadRun.achieved_rps", "0.0 -> 1.0", "else 0.0", "a run lasts at least one interval"),
        ("_record", "1000000000.0 -> 1500000000.0", "else 1e9", _NO_ANSWER),
        ("sustainable_rate", "2.0 -> 3.0", "rate_rps=2.0, duration_s=1.0", _START),
        ("sustainable_rate", "1.0 -> 1.5", "rate_rps=2.0, duration_s=1.0", _START),
        ("sustainable_rate", "max() -> min()", "start_rps = max(1.0", _START),
        ("sustainable_rate", "1.0 -> 1.5", "start_rps = max(1.0", _START),
        ("sustainable_rate", "/ -> *", "start_rps = max(1.0", _START),
        ("sustainable_rate", "250.0 -> 375.0", "start_rps = max(1.0", _START),
        ("sustainable_rate", "50 -> 51", "start_rps = max(1.0", _START),
        ("sustainable_rate", "cmp0: >= -> >", "while rate >= MIN_RATE_RPS", _FLOAT_EDGE),
        ("sustainable_rate", "cmp0: <= -> <", "while rate <= max_rps", _FLOAT_EDGE),
        ("sustainable_rate", "cmp0: <= -> <", "if rate <= max_rps", _FLOAT_EDGE),
        ("_Sizer.search", "5.0 -> 7.5", "# warm-up", _WARM_UP),
        ("_Sizer.search", "1.0 -> 1.5", "# warm-up", _WARM_UP),
        ("generator_check", "20.0 -> 30.0", "# connections and caches warm", _WARM_UP),
        ("generator_check", "0.5 -> 0.75", "# connections and caches warm", _WARM_UP),
        ("_Sizer.size", "50 -> 51", "percentile(50)", "neighbouring percentiles: noise"),
        ("_Sizer.size", "3 -> 4", "round(best.percentile", _DIGITS),
        ("_Sizer.size", "5 -> 6", "requests), 5)", _DIGITS),
        ("_Sizer.size", "1 -> 2", "round(search.rss_mb, 1)", _DIGITS),
        ("_Sizer.size", "1 -> 2", "max(1, requests)", "a search sends hundreds of requests"),
        ("measure_sizes", "/ -> *", "held_rps / step", _START),
        ("rate_at", "cmp0: < -> <=", "vcpus < top", "vcpus == top is measured: returned above"),
        ("rate_at", "1.0 -> 1.5", "exponent = 1.0", "clamped to at most 1.0 below"),
        ("fleet_options", "0.0 -> 1.0", "p.rss_mb or 0.0", "1 MB or 0 rules out no 4 GiB type"),
        ("fleet_options", "0 -> 1", "rate <= 0", "a size's rate is 0, or at least 1 req/s"),
        (
            "fleet_options",
            "0.0 -> 1.0",
            "o.usd_per_hour or 0.0",
            "unpriced: ranked by the key before",
        ),
        ("_reason", "0.0 -> 1.0", "in points), default=0.0", "a point per size, never none"),
    ),
    "budget": (
        (
            "resolve_costs",
            "cmp0: <= -> <",
            "if training_usd <= 0:",
            "a budget the reserve spends exactly is refused by time_budget's minimum instead",
        ),
        (
            "sizing_budget",
            "cmp0: > -> >=",
            "> AUTO_SIZING_SHARE",
            "a reserve exactly a quarter of the budget, to the float",
        ),
        ("sizing_budget", "6 -> 7", "round(reserve / 3600.0, 6)", "to the micro-dollar"),
    ),
    "sizing-boxes": (
        (
            "size_on_boxes",
            "cmp0: >= -> >",
            "if clock() >= ends:",
            "the time bound, to one reading of the clock",
        ),
        (
            "_Boxes.end_earlier",
            "1 -> 2",
            'split("/", 1)[0]',
            "the first part of the path is the same however many splits follow",
        ),
    ),
    "billing": (
        (
            "attempt_bills",
            "1 -> 2",
            "last_attempt + 1",
            "attempts past the last one have no record: looking for one more finds none",
        ),
    ),
    "cost-model": (
        (
            "time_budget",
            "6 -> 7",
            "3600.0, 6)",
            "rounds away float noise only: any precision from 1e-3 to 1e-9 s gives the same "
            "whole seconds",
        ),
    ),
    "interference": (
        (
            "_watched",
            "cmp0: <= -> <",
            "if load.others_share <= limits.others_share",
            "a share exactly at the limit, to the tick: whether that reading is kept as quiet",
        ),
        ("psi_some_us", "1 -> 2", 'split("=", 1)', "PSI's fields hold one '=' each"),
        (
            "_cgroup_cpu_stat",
            "and -> or",
            'hid == "0" and controllers == ""',
            "the kernel writes hierarchy 0 exactly when no controller is named (cgroups(7))",
        ),
        ("own_cpu_s", "+ -> -", "t.user + t.system", "this process's system time: a few ms"),
        ("own_cpu_s", "+ -> -", "c.user + c.system", "a service's system time: a few ms"),
        ("Window.close", "1e-06 -> 1.5e-06", "1e-6)", "a divide-by-zero guard"),
        ("Window.close", "cmp0: > -> >=", "throttled >", "throttling exactly at the limit"),
        ("Window.close", "3 -> 4", "round(own, 3)", _DIGITS),
        ("Window.close", "4 -> 5", "round(psi, 4)", _DIGITS),
        ("Window.close", "3 -> 4", "round(quiet_ms, 3)", _DIGITS),
        ("QuietFigure.offer", "cmp0: <= -> <", "quiet <= ms", "rewrites the same figure"),
    ),
    "pricing": (
        (
            "on_demand_from_price_list",
            "10 -> 11",
            "MaxResults=10",
            "page size of a filtered query whose lowest rate is taken",
        ),
        ("refresh_from_pricing_api", "2 -> 3", "indent=2", _JSON),
        ("refresh_from_pricing_api", "True -> False", "sort_keys=True", _JSON),
    ),
}


TARGETS = (
    Target("gate", "burstcv.gate.gate", ("tests/gate/test_gate.py",), tables=("*",)),
    Target("registry", "burstcv.registry.registry", ("tests/registry/test_registry.py",)),
    Target(
        "deploy",
        "burstcv.registry.deploy",
        ("tests/registry/test_deploy.py", "tests/registry/test_deploy_races.py"),
    ),
    Target(
        "admission",
        "burstcv_serving.admission",
        ("tests/serving/test_serving_admission.py",),
        tables=("*",),
    ),
    Target(
        "model-manager",
        "burstcv_serving.manager",
        ("tests/serving/test_serving_reload.py", "tests/serving/test_serving_manager.py"),
    ),
    Target("reaper", "burstcv.compute.reaper", ("tests/compute/test_reaper.py",)),
    Target(
        "ec2-terms",
        "burstcv.compute.ec2_terms",
        (
            "tests/compute/test_ec2.py",
            "tests/compute/test_prices.py",
            "tests/compute/test_reaper.py",
            "tests/compute/test_leaks.py",
        ),
        tables=("*",),
    ),
    Target(
        "attempts",
        "burstcv.compute.attempts",
        (
            "tests/compute/test_ec2.py",
            "tests/compute/test_resume.py",
            "tests/training/test_rank_markers.py",
        ),
    ),
    Target(
        "job",
        "burstcv.training.job",
        ("tests/training/test_job.py", "tests/training/test_rank_markers.py"),
    ),
    Target(
        "chunks",
        "burstcv.data.chunks",
        ("tests/data/test_chunks.py",),
    ),
    Target(
        "task-sizing",
        "burstcv.stages.data",
        ("tests/data/test_chunks.py",),
    ),
    Target(
        "scan-pool",
        "burstcv.data.scanner.dispatch",
        ("tests/data/test_chunks.py",),
    ),
    Target(
        "recipe",
        "burstcv.training.recipe",
        ("tests/training/test_recipe.py",),
        tables=("*",),
    ),
    Target(
        "world-scale",
        "burstcv.training.world",
        ("tests/training/test_train.py",),
    ),
    Target(
        "job-outcome",
        "burstcv.compute.base",
        ("tests/compute/test_ec2.py",),
    ),
    Target(
        "liveness", "burstcv.compute.liveness", ("tests/compute/test_liveness.py",), tables=("*",)
    ),
    Target(
        "preflight",
        "burstcv.training.preflight",
        ("tests/training/test_preflight.py",),
        tables=("*",),
    ),
    Target(
        "nothing-new",
        "burstcv.stages.resolve",
        ("tests/test_pipeline_decisions.py",),
    ),
    Target(
        "gate-stage",
        "burstcv.stages.gate",
        ("tests/test_pipeline_decisions.py",),
    ),
    Target(
        "budget",
        "burstcv.cost.budget",
        (
            "tests/cost/test_budget.py",
            "tests/test_pipeline_decisions.py",
            "tests/cost/test_pricing.py",
            "tests/compute/test_prices.py",
        ),
    ),
    Target(
        "boot",
        "burstcv.cost.boot",
        ("tests/cost/test_budget.py", "tests/test_pipeline_decisions.py"),
        tables=("*",),
    ),
    Target(
        "cost-model",
        "burstcv.cost.model",
        ("tests/cost/test_model.py", "tests/test_pipeline_decisions.py"),
        tables=("*",),
    ),
    Target(
        "billing",
        "burstcv.compute.billing",
        ("tests/compute/test_billing.py",),
    ),
    Target(
        "quotes",
        "burstcv.cost.quotes",
        ("tests/compute/test_prices.py",),
    ),
    Target(
        "sizing",
        "burstcv.gate.sizing",
        ("tests/gate/test_sizing.py", "tests/gate/test_loadgen.py"),
    ),
    Target(
        "sizing-boxes",
        "burstcv.compute.sizing_boxes",
        ("tests/compute/test_sizing_orchestration.py",),
        jobs=1,
    ),
    Target(
        "loadgen",
        "burstcv.gate.loadgen",
        ("tests/gate/test_loadgen.py",),
    ),
    Target(
        "interference",
        "burstcv.gate.interference",
        ("tests/gate/test_interference.py",),
        tables=("*",),
        jobs=1,
    ),
    Target(
        "deadline",
        "burstcv.compute.userdata",
        ("tests/compute/test_userdata.py",),
    ),
    Target(
        "aws-check",
        "burstcv.compute.awscheck",
        ("tests/compute/test_aws_check.py", "tests/compute/test_resume.py"),
    ),
    Target(
        "pricing",
        "burstcv.cost.pricing",
        ("tests/cost/test_pricing.py", "tests/compute/test_prices.py"),
        tables=("*",),
    ),
)

_SWAP_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_SWAP_BINOP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
}
_OP_TEXT = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.And: "and",
    ast.Or: "or",
}


@dataclass
class Mutant:
    """One deliberate bug: where it is, what it changes, and how to put it in."""

    index: int  # the site's rank in the walk (mutants are re-derived from a fresh parse)
    line: int
    function: str  # the outermost function's qualname; "" for a module-level table
    what: str
    source_line: str = ""
    status: str = ""  # caught | survived | timeout | no-tests | not-applied | equivalent
    why: str = ""  # for an equivalent mutant
    tests: list[str] = field(default_factory=list)


def _nudge(value: int | float) -> int | float:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    return value * 1.5 if value else 1.0


class _Sites(ast.NodeVisitor):
    """Walk a module and yield each mutation site with a function that applies it."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.stack: list[str] = []
        self.outer = ""
        self.in_table = False
        self.sites: list[tuple[ast.AST, str, str]] = []  # node, outer function, description

    # Scopes -------------------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.visit(stmt)
        self.stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        qualname = ".".join([*self.stack, node.name])
        if self.outer:  # a nested function: part of the outer one's code
            self._body(node)
            return
        self.outer = qualname
        self._body(node)
        self.outer = ""

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _body(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        for stmt in body:
            self.visit(stmt)

    def visit_Module(self, node: ast.Module) -> None:
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.visit(stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and self._is_table(stmt):
                self.in_table = True
                if stmt.value is not None:
                    self.visit(stmt.value)
                self.in_table = False

    def _is_table(self, stmt: ast.Assign | ast.AnnAssign) -> bool:
        if not self.target.tables:
            return False
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        return any(n in self.target.tables or "*" in self.target.tables for n in names)

    # Sites ---------------------------------------------------------------------------------
    def _add(self, node: ast.AST, what: str) -> None:
        if self.outer or self.in_table:
            self.sites.append((node, self.outer, what))

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)  # not the annotation

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        for value in node.values:  # an f-string's expressions, not its format specs
            if isinstance(value, ast.FormattedValue):
                self.visit(value.value)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in {"debug", "info", "warning", "error", "exception"}
            and isinstance(func.value, ast.Name)
            and func.value.id in {"log", "logger"}
        ):
            return  # log lines: what they say is not a decision
        if isinstance(func, ast.Name) and func.id in ("min", "max"):
            self._add(node, f"{func.id}() -> {'max' if func.id == 'min' else 'min'}()")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            swap = _SWAP_COMPARE.get(type(op))
            if swap is not None:
                self._add(node, f"cmp{i}: {_OP_TEXT[type(op)]} -> {_OP_TEXT[swap]}")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        a, b = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        self._add(node, f"{a} -> {b}")
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._add(node, "not dropped")
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = _SWAP_BINOP.get(type(node.op))
        if swap is not None and not _is_string_format(node):
            self._add(node, f"{_OP_TEXT[type(node.op)]} -> {_OP_TEXT[swap]}")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        swap = _SWAP_BINOP.get(type(node.op))
        if swap is not None:
            self._add(node, f"{_OP_TEXT[type(node.op)]}= -> {_OP_TEXT[swap]}=")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, (bool, int, float)) and not isinstance(node.value, complex):
            self._add(node, f"{node.value!r} -> {_nudge(node.value)!r}")

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None
        ):
            self._add(node, "return value dropped (None)")
        self.generic_visit(node)


def _is_string_format(node: ast.BinOp) -> bool:
    return any(
        isinstance(side, (ast.JoinedStr,))
        or (isinstance(side, ast.Constant) and isinstance(side.value, str))
        for side in (node.left, node.right)
    )


def _apply(node: ast.AST, what: str) -> None:
    """Change ``node`` in place as ``what`` says."""
    if isinstance(node, ast.Compare):
        i = int(what.split(":")[0][3:])
        node.ops[i] = _SWAP_COMPARE[type(node.ops[i])]()
    elif isinstance(node, ast.BoolOp):
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        node.op = _SWAP_BINOP[type(node.op)]()
    elif isinstance(node, ast.Constant):
        node.value = _nudge(node.value)
    elif isinstance(node, ast.Return):
        node.value = None
    elif isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        node.func.id = "max" if node.func.id == "min" else "min"
    else:
        raise AssertionError(what)


def _drop_not(tree: ast.AST, target: ast.UnaryOp) -> None:
    for parent in ast.walk(tree):
        for name, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, name, target.operand)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is target:
                        value[i] = target.operand
                        return


def sites(target: Target, source: str) -> tuple[ast.Module, list[tuple[ast.AST, str, str]]]:
    tree = ast.parse(source)
    walker = _Sites(target)
    walker.visit(tree)
    return tree, walker.sites


def mutants_of(target: Target, source: str) -> list[Mutant]:
    lines = source.splitlines()
    _, found = sites(target, source)
    return [
        Mutant(i, node.lineno, outer, what, lines[node.lineno - 1].strip())  # type: ignore[attr-defined]
        for i, (node, outer, what) in enumerate(found)
    ]


# Putting a mutant into the live module -------------------------------------------------------
def _live_functions(module: types.ModuleType) -> dict[str, list[types.FunctionType]]:
    """Every function object defined in ``module``'s file, by qualname."""
    found: dict[str, list[types.FunctionType]] = {}
    seen: set[int] = set()
    filename = module.__file__

    def add(obj: Any) -> None:
        while True:
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
            elif isinstance(obj, property):
                for part in (obj.fget, obj.fset, obj.fdel):
                    if part is not None:
                        add(part)
                return
            elif hasattr(obj, "__wrapped__") and not isinstance(obj, types.FunctionType):
                obj = obj.__wrapped__
            else:
                break
        if isinstance(obj, types.FunctionType) and id(obj) not in seen:
            seen.add(id(obj))
            if obj.__code__.co_filename == filename:
                found.setdefault(obj.__code__.co_qualname, []).append(obj)
            wrapped = getattr(obj, "__wrapped__", None)
            if wrapped is not None:
                add(wrapped)

    def walk(namespace: dict[str, Any], depth: int) -> None:
        for value in list(namespace.values()):
            if isinstance(value, type) and value.__module__ == module.__name__ and depth < 4:
                walk(dict(vars(value)), depth + 1)
            else:
                add(value)

    walk(vars(module), 0)
    return found


def _code_named(code: types.CodeType, qualname: str) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_qualname == qualname:
                return const
            inner = _code_named(const, qualname)
            if inner is not None:
                return inner
    return None


def put_in(target: Target, mutant: Mutant) -> bool:
    """Put ``mutant`` into the imported module; False if it cannot be (nothing to swap)."""
    module = importlib.import_module(target.module)
    path = Path(module.__file__ or "")
    tree, found = sites(target, path.read_text())
    node, outer, what = found[mutant.index]
    if what == "not dropped":
        assert isinstance(node, ast.UnaryOp)
        _drop_not(tree, node)
    else:
        _apply(node, what)
    ast.fix_missing_locations(tree)
    if not outer:  # a module-level table: re-run its assignment
        for stmt in tree.body:
            if stmt.lineno <= mutant.line <= (stmt.end_lineno or stmt.lineno):
                exec(compile(ast.Module([stmt], []), str(path), "exec"), vars(module))
                return True
        return False
    compiled = compile(tree, str(path), "exec")
    code = _code_named(compiled, outer)
    live = _live_functions(module).get(outer, [])
    if code is None or not live:
        return False
    defaults = _defaults_holding(tree, outer, node)
    for function in live:
        try:
            function.__code__ = code
        except ValueError:  # free variables differ (cannot happen for one-token mutants)
            return False
        if defaults is not None:  # defaults are values made at definition, not code
            try:
                _set_defaults(function, defaults, module, path)
            except Exception:  # e.g. a default naming a class attribute
                return False
    return True


def _defaults_holding(tree: ast.Module, outer: str, node: ast.AST) -> ast.arguments | None:
    """Return the arguments of function ``outer`` if ``node`` is in one of its defaults."""
    stack: list[tuple[list[str], ast.AST]] = [([], tree)]
    while stack:
        names, parent = stack.pop()
        for child in ast.iter_child_nodes(parent):
            if isinstance(child, ast.ClassDef):
                stack.append(([*names, child.name], child))
            elif (
                isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                and ".".join([*names, child.name]) == outer
            ):
                given = [*child.args.defaults, *(d for d in child.args.kw_defaults if d)]
                if any(node is n for d in given for n in ast.walk(d)):
                    return child.args
                return None
    return None


def _set_defaults(
    function: types.FunctionType, args: ast.arguments, module: types.ModuleType, path: Path
) -> None:
    def value(expr: ast.expr) -> Any:
        return eval(compile(ast.Expression(expr), str(path), "eval"), vars(module))

    if args.defaults:
        function.__defaults__ = tuple(value(d) for d in args.defaults)
    pairs = zip(args.kwonlyargs, args.kw_defaults, strict=True)
    kw = {a.arg: value(d) for a, d in pairs if d is not None}
    if kw:
        function.__kwdefaults__ = kw


# Running tests in forked children ------------------------------------------------------------
class _Recorder:
    """A pytest plugin: which test calls which function of the module, and how long it takes."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.current: str | None = None
        self.calls: dict[str, set[str]] = {}
        self.durations: dict[str, float] = {}
        self.failed: list[str] = []

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        del arg
        if event == "call" and self.current is not None:
            code = frame.f_code
            if code.co_filename == self.filename:
                outer = code.co_qualname.split(".<locals>.")[0]
                self.calls.setdefault(outer, set()).add(self.current)

    def pytest_runtest_setup(self, item: Any) -> None:
        self.current = item.nodeid
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def pytest_runtest_teardown(self, item: Any) -> None:
        del item

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            self.failed.append(report.nodeid)
        if report.when == "teardown":
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            self.current = None


def _pytest_args(tests: list[str]) -> list[str]:
    return ["-x", "-q", "--no-header", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]


def _in_child(fn: Any, timeout_s: float | None = None) -> tuple[str, Any]:
    """Run ``fn`` in a forked child; return ("ok", value) | ("error", text) | ("timeout", None)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            value = ("ok", fn())
        except BaseException as exc:
            value = ("error", repr(exc))
        with os.fdopen(write_fd, "w") as out:
            json.dump(value, out)
        os._exit(0)
    os.close(write_fd)
    return _wait_child(pid, read_fd, timeout_s)


def _wait_child(pid: int, read_fd: int, timeout_s: float | None) -> tuple[str, Any]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    chunks: list[bytes] = []
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read_fd], [], [], wait)
        if not ready:
            os.killpg(pid, signal.SIGKILL) if _own_group(pid) else os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return ("timeout", None)
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    if not chunks:
        return ("error", "the child died without a word")
    status, value = json.loads(b"".join(chunks))
    return status, value


def _own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _quiet() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def baseline(target: Target) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Run the target's tests unmutated; return the tests per function and their durations."""
    module = importlib.import_module(target.module)

    def record() -> dict[str, Any]:
        import pytest

        os.setpgid(0, 0)
        _quiet()
        recorder = _Recorder(module.__file__ or "")
        code = pytest.main(["-q", "-p", "no:cacheprovider", *target.tests], plugins=[recorder])
        return {
            "code": int(code),
            "failed": recorder.failed,
            "calls": {k: sorted(v) for k, v in recorder.calls.items()},
            "durations": recorder.durations,
        }

    status, value = _in_child(record)
    if status != "ok" or value["code"] != 0:
        raise SystemExit(
            f"{target.name}: its tests do not pass unmutated ({status}: "
            f"{value if status != 'ok' else value['failed']}); fix them first"
        )
    return value["calls"], value["durations"]


def warm_up(target: Target) -> None:
    """Import the tests, their conftest and the Airflow DB they need once, in this process.

    Every forked child then starts from them; pytest's sessions in the children reuse the
    imported modules, so a mutant swapped into a function is seen by every test.
    """
    import pytest

    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *target.tests])
    if code != 0:
        raise SystemExit(f"{target.name}: its tests cannot be collected (pytest exit {code})")


def run_target(target: Target, jobs: int) -> list[Mutant]:
    jobs = min(jobs, target.jobs or jobs)
    warm_up(target)
    module = importlib.import_module(target.module)
    source = Path(module.__file__ or "").read_text()
    mutants = mutants_of(target, source)
    calls, durations = baseline(target)
    everything = sorted(durations, key=durations.__getitem__)
    for m in mutants:
        chosen = calls.get(m.function, []) if m.function else everything
        m.tests = sorted(set(chosen), key=lambda t: durations.get(t, 0.0))
        if not m.tests:
            m.status = "no-tests"
    queue: Iterator[Mutant] = iter([m for m in mutants if not m.status])
    running: dict[int, tuple[Mutant, int, float]] = {}  # pid -> mutant, read fd, deadline
    started = time.monotonic()
    while True:
        while len(running) < jobs:
            m = next(queue, None)
            if m is None:
                break
            limit = 3 * sum(durations.get(t, 0.0) for t in m.tests) + 20.0
            pid, fd = _start_mutant(target, m)
            running[pid] = (m, fd, time.monotonic() + limit)
        if not running:
            break
        _reap_one(running)
    for m in mutants:
        if m.status in ("survived", "no-tests") and (why := target.equivalent(m)):
            m.status, m.why = "equivalent", why
    caught, total, pct = score(mutants)
    print(
        f"  {target.name}: {len(mutants)} mutants in {time.monotonic() - started:.0f} s: "
        f"{caught} of {total} caught ({pct:.1f}%)"
    )
    return mutants


def _start_mutant(target: Target, m: Mutant) -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.setpgid(0, 0)
        try:
            if not put_in(target, m):
                result = "not-applied"
            else:
                import pytest

                _quiet()
                code = int(pytest.main(_pytest_args(m.tests)))
                result = "survived" if code == 0 else "caught"
        except BaseException:
            result = "caught"
        os.write(write_fd, result.encode())
        os._exit(0)
    os.close(write_fd)
    return pid, read_fd


def _reap_one(running: dict[int, tuple[Mutant, int, float]]) -> None:
    fds = {fd: pid for pid, (_, fd, _) in running.items()}
    soonest = min(deadline for _, _, deadline in running.values())
    ready, _, _ = select.select(list(fds), [], [], max(0.0, soonest - time.monotonic()))
    now = time.monotonic()
    for pid, (m, fd, deadline) in list(running.items()):
        if fd in ready:
            m.status = os.read(fd, 64).decode() or "caught"  # died without a word: caught
        elif now >= deadline:
            m.status = "timeout"
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        else:
            continue
        os.close(fd)
        os.waitpid(pid, 0)
        del running[pid]


def score(mutants: list[Mutant]) -> tuple[int, int, float]:
    counted = [m for m in mutants if m.status not in ("not-applied", "equivalent")]
    caught = sum(m.status in ("caught", "timeout") for m in counted)
    return caught, len(counted), 100.0 * caught / len(counted) if counted else 100.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help="target names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--fail-under",
        type=float,
        default=0.0,
        metavar="PCT",
        help="exit 1 when a module's score is under PCT",
    )
    args = parser.parse_args(argv)
    chosen = [t for t in TARGETS if not args.targets or t.name in args.targets]
    unknown = set(args.targets) - {t.name for t in TARGETS}
    if unknown:
        parser.error(
            f"unknown target(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(t.name for t in TARGETS)}"
        )
    os.chdir(REPO)
    sys.path.insert(0, str(REPO / "tests"))
    results: dict[str, list[Mutant]] = {}
    for target in chosen:
        module = importlib.import_module(target.module)
        if args.list:
            for m in mutants_of(target, Path(module.__file__ or "").read_text()):
                print(f"{target.name}:{m.line} {m.function or '(table)'}: {m.what}")
            continue
        results[target.name] = run_target(target, args.jobs)
    if args.list:
        return 0
    print()
    print(f"{'module':<15} {'mutants':>8} {'caught':>7} {'score':>7} {'equivalent':>11}")
    for name, mutants in results.items():
        caught, total, pct = score(mutants)
        same = sum(m.status == "equivalent" for m in mutants)
        print(f"{name:<15} {total:>8} {caught:>7} {pct:>6.1f}% {same:>11}")
    for name, mutants in results.items():
        target = next(t for t in TARGETS if t.name == name)
        left = [m for m in mutants if m.status in ("survived", "no-tests")]
        if left:
            print(f"\nsurviving in {name} ({target.module}):")
            for m in left:
                note = " (no test calls it)" if m.status == "no-tests" else ""
                print(f"  line {m.line} {m.function or '(table)'}: {m.what}{note}")
                print(f"      {m.source_line[:100]}")
        same = [m for m in mutants if m.status == "equivalent"]
        if same:
            print(f"\nequivalent in {name} (not counted):")
            for m in same:
                print(f"  line {m.line} {m.function}: {m.what}: {m.why}")
    below = [name for name, ms in results.items() if score(ms)[2] < args.fail_under]
    if below:
        print(f"\nunder {args.fail_under:g}%: {', '.join(below)}")
    if args.json:
        args.json.write_text(
            json.dumps({name: [m.__dict__ for m in ms] for name, ms in results.items()}, indent=1)
        )
    return 1 if below else 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="burstcv-mutation-") as session:
        os.environ["BURSTCV_TEST_SESSION_DIR"] = session  # tests/conftest.py: one for all runs
        sys.exit(main())
