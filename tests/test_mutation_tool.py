"""The mutation tester (tests/mutation/run.py) finds the sites and really swaps the bug in."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "burstcv_mutation_run", Path(__file__).resolve().parent / "mutation" / "run.py"
)
assert _SPEC is not None and _SPEC.loader is not None
mutation = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = mutation  # its dataclasses look their module up
_SPEC.loader.exec_module(mutation)

SOURCE = textwrap.dedent(
    '''
    """A toy decision module."""
    import logging

    log = logging.getLogger(__name__)
    LIMITS = {"small": 2, "large": 8}
    NAME = "toy"


    def fits(size: str, load: int) -> bool:
        """Say whether ``load`` fits ``size``."""
        return load <= LIMITS[size] and not size.startswith("x")


    class Picker:
        def pick(self, loads: list[int]) -> int:
            log.info("picking from %d", 3)
            return min(loads) + 1
    '''
)


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"burstcv_mutation_toy_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_the_sites_are_the_decisions_not_the_docstrings_logs_or_strings(toy: str) -> None:
    target = mutation.Target("toy", toy, (), tables=("LIMITS",))
    found = {(m.function or "(table)", m.what) for m in mutation.mutants_of(target, SOURCE)}
    assert found == {
        ("(table)", "2 -> 3"),
        ("(table)", "8 -> 9"),
        ("fits", "cmp0: <= -> <"),
        ("fits", "and -> or"),
        ("fits", "not dropped"),
        ("fits", "return value dropped (None)"),
        ("Picker.pick", "min() -> max()"),
        ("Picker.pick", "+ -> -"),
        ("Picker.pick", "1 -> 2"),
        ("Picker.pick", "return value dropped (None)"),
    }


def test_a_mutant_is_seen_through_every_reference_the_tests_hold(toy: str) -> None:
    module = importlib.import_module(toy)
    fits, picker = module.fits, module.Picker()  # bound before the swap, as a test's import is
    target = mutation.Target("toy", toy, (), tables=("LIMITS",))
    mutants = {(m.function, m.what): m for m in mutation.mutants_of(target, SOURCE)}
    assert fits("small", 2) is True
    assert mutation.put_in(target, mutants[("fits", "cmp0: <= -> <")])
    assert fits("small", 2) is False  # exactly at the limit: the flipped comparison shows
    assert mutation.put_in(target, mutants[("Picker.pick", "min() -> max()")])
    assert picker.pick([1, 5]) == 6


def test_a_table_mutant_changes_what_the_functions_read(toy: str) -> None:
    module = importlib.import_module(toy)
    target = mutation.Target("toy", toy, (), tables=("LIMITS",))
    table = next(m for m in mutation.mutants_of(target, SOURCE) if m.what == "8 -> 9")
    assert module.fits("large", 9) is False
    assert mutation.put_in(target, table)
    assert module.fits("large", 9) is True


def test_the_score_counts_timeouts_as_caught_and_leaves_out_what_could_not_be_applied() -> None:
    ms = [
        mutation.Mutant(i, 1, "f", "x", status=s)
        for i, s in enumerate(
            ["caught", "timeout", "survived", "no-tests", "not-applied", "equivalent"]
        )
    ]
    assert mutation.score(ms) == (2, 4, 50.0)


def test_every_target_names_a_module_and_tests_that_exist() -> None:
    repo = Path(__file__).resolve().parents[1]
    for target in mutation.TARGETS:
        assert importlib.util.find_spec(target.module) is not None, target.module
        for test in target.tests:
            assert (repo / test).is_file(), test
        module = importlib.import_module(target.module)
        source = Path(module.__file__ or "").read_text()
        assert mutation.mutants_of(target, source), f"{target.name}: no mutant"


def test_a_default_value_mutant_changes_the_default_the_function_uses(toy: str) -> None:
    source = SOURCE + "\n\ndef ceiling(load: int, limit: int = 4, *, spare: int = 1) -> bool:\n"
    source += "    return load <= limit - spare\n"
    module_file = Path(importlib.import_module(toy).__file__ or "")
    module_file.write_text(source)
    module = importlib.reload(importlib.import_module(toy))
    ceiling = module.ceiling
    target = mutation.Target("toy", toy, ())
    found = {(m.function, m.what, m.line): m for m in mutation.mutants_of(target, source)}
    limit_line = next(m for m in found.values() if m.function == "ceiling" and m.what == "4 -> 5")
    assert ceiling(4) is False
    assert mutation.put_in(target, limit_line)
    assert ceiling(4) is True  # the default is now 5: the mutant is live


def test_every_listed_equivalent_mutant_is_one_the_module_has() -> None:
    for target in mutation.TARGETS:
        module = importlib.import_module(target.module)
        mutants = mutation.mutants_of(target, Path(module.__file__ or "").read_text())
        for function, what, fragment, _ in mutation.EQUIVALENT.get(target.name, ()):
            assert any(
                target.equivalent(m)
                and (m.function, m.what) == (function, what)
                and fragment in m.source_line
                for m in mutants
            ), f"{target.name}: no mutant {function}: {what} on a line with {fragment!r}"
