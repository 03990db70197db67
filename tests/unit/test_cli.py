"""The ``pdserve`` dispatcher and ``pdserve bench``, the entry point of a separate distribution
(pdserve-bench): without it, one line that says how to install it; a dependency missing inside
it is not mistaken for it."""

from __future__ import annotations

import sys

import pytest

from pdserve.cli import main

NOT_INSTALLED = "the pdserve-bench package (pip install -e ./bench)"


def test_bench_without_its_package_names_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules: the import fails as for a package that is not installed.
    monkeypatch.setitem(sys.modules, "pdserve_bench", None)
    assert main(["bench", "serve", "--help"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("pdserve bench: error: ")
    assert "pdserve-bench" in lines[0] and "pip install -e ./bench" in lines[0]


def test_a_module_missing_inside_the_benchmarks_is_raised_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("pdserve_bench", reason=NOT_INSTALLED)
    # Imported afresh, the package finds one of its own imports missing.
    monkeypatch.delitem(sys.modules, "pdserve_bench")
    monkeypatch.setitem(sys.modules, "argparse", None)
    with pytest.raises(ModuleNotFoundError) as err:
        main(["bench", "--help"])
    assert err.value.name == "argparse"


def test_bench_lists_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pdserve_bench", reason=NOT_INSTALLED)
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for name in ("engine", "transfer", "overhead", "serve", "faults", "guided"):
        assert f"\n  {name} " in out
