"""`epick bench NAME`: every benchmark in one home (epick.bench), reachable by name; the
checkout it reads from found, or its absence named."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

from epick.bench import checkout
from epick.bench.cli import BENCHMARKS, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_named_benchmark_is_a_module_of_epick_bench_with_main_argv(name):
    module = importlib.import_module(f"epick.bench.{BENCHMARKS[name]}")
    assert list(inspect.signature(module.main).parameters) == ["argv"], name


def test_every_benchmark_module_of_the_package_has_a_name():
    """A new benchmark file gets a sub-command (helpers are listed here as not runnable)."""
    # overload: the flow-control workload `epick bench quality --workloads overload` runs.
    # regress_worker: one side of `epick bench regress`'s interleaved mode.
    # grpc_ab: `epick bench pick --grpc --base REF`, this tree beside a ref.
    helpers = {"__init__", "cli", "checkout", "timing", "pypolicies", "kvsim", "grpc",
               "pages", "floor", "profile", "dataplanes", "overload", "regress_worker",
               "grpc_ab"}
    files = {p.stem for p in (ROOT / "host" / "bench").glob("*.py")}
    assert sorted(files - helpers) == sorted(BENCHMARKS.values())


def test_the_old_homes_are_gone():
    assert not list(ROOT.glob("bench/*.py"))
    assert not (ROOT / "host" / "pool" / "bench.py").exists()
    assert not (ROOT / "scripts" / "envoy_bench.py").exists()


def test_a_named_benchmark_runs_with_its_arguments(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["parse-pages", "--help"])
    assert stop.value.code == 0
    assert "parse_page" in capsys.readouterr().out


def test_an_unknown_benchmark_names_the_choices(capsys):
    assert main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "sandbox-under-fire" in err


def test_no_arguments_print_the_list_and_fail():
    assert main([]) == 2
    assert main(["--help"]) == 0


def test_checkout_paths_resolve_in_this_checkout_and_a_missing_one_is_named():
    assert checkout.REPO == ROOT
    assert checkout.path("tests", "pool", "fixtures").is_dir()
    with pytest.raises(checkout.CheckoutError, match=r"tests/nope\.txt"):
        checkout.path("tests", "nope.txt")


def test_a_tests_module_is_imported_the_way_pytest_imports_it():
    harness = checkout.tests_module("envoy", "envoy_harness")
    assert harness.EXAMPLE == ROOT / "examples" / "envoy" / "envoy.yaml"
    assert str(ROOT / "tests" / "envoy") in sys.path
    with pytest.raises(checkout.CheckoutError, match="nothing_here.py"):
        checkout.tests_module("envoy", "nothing_here")
