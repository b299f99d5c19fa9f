"""`epick bench regress`: the guard's arithmetic, its verdict, its refusals, one real run.

Nothing here asserts a timing: the verdict is tested on given ratios, the real run only
for the shape of its output.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from epick.bench import regress, regress_worker
from epick.bench.regress import RegressError

REPO = Path(regress.__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A one-commit git repo shaped like epick's: host/ is the package, conformance/ mapped."""
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "__init__.py").write_text("")
    (tmp_path / "conformance").mkdir()
    (tmp_path / "conformance" / "__init__.py").write_text("WHO = 'conformance'\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"epick" = "host"\n"epick.conformance" = "conformance"\n')
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_the_p50_is_read_from_the_workloads_report_line():
    line = "answer_pick, 64 endpoints, 4000 picks: p50 54.7 µs, p99 86.2 µs, mean 60.1 µs\n"
    assert regress.parse_p50(line) == 54.7
    with pytest.raises(RegressError, match="no single 'p50 N µs'"):
        regress.parse_p50("Traceback: something else\n")


def test_ratio_is_tree_over_base_per_alternation():
    assert regress.ratio(120.0, 100.0) == pytest.approx(1.2)
    assert regress.alternation_ratios([110.0, 90.0], [100.0, 100.0]) == pytest.approx([1.1, 0.9])
    with pytest.raises(RegressError, match="2 tree runs but 1 base runs"):
        regress.alternation_ratios([1.0, 2.0], [1.0])
    with pytest.raises(RegressError, match="positive"):
        regress.ratio(1.0, 0.0)


def test_only_every_one_of_three_alternations_above_the_limit_is_a_regression():
    assert regress.verdict([1.2, 1.3, 1.16], 1.15)
    assert regress.verdict([1.2, 1.3, 1.16, 1.5], 1.15)
    # One quiet alternation clears it: noise on a shared machine must not fail CI.
    assert not regress.verdict([1.2, 1.14, 1.5], 1.15)
    assert not regress.verdict([1.15, 1.2, 1.2], 1.15)  # at the limit is not above it
    # Fewer than three alternations never judge, however bad.
    assert not regress.verdict([2.0, 2.0], 1.15)


def test_the_report_names_the_regressed_size_only():
    got = regress.Sizes()
    for tree, base in ((130, 100), (125, 100), (140, 100)):
        got.add("tree", 8, tree)
        got.add("base", 8, base)
    # The ratio is the median of the pairs (1.10), not of the sides' medians (1.30 / 1.0).
    for tree, base in ((110, 100), (200, 250), (130, 100)):
        got.add("tree", 16, tree)
        got.add("base", 16, base)
    for tree, base in ((130, 100), (100, 100), (140, 100)):
        got.add("tree", 64, tree)
        got.add("base", 64, base)
    lines, failed = regress.report((8, 64), got, 1.15)
    assert failed
    assert "ratio tree ÷ base 1.100 (per alternation 1.10 0.80 1.30)" in regress.report(
        (16,), got, 1.15)[0][0]
    assert lines[0].startswith("8 endpoints: base p50 100.0 µs, tree p50 130.0 µs (medians), "
                               "ratio tree ÷ base 1.300 (per alternation 1.30 1.25 1.40)")
    assert "REGRESSION" in lines[0] and "REGRESSION" not in lines[1]
    assert not regress.report((8, 64), got, None)[1]  # no limit: report only


def test_a_missing_base_ref_is_a_clear_error(repo: Path):
    with pytest.raises(RegressError, match=r"base ref 'no-such-ref' is not a commit in .*"
                                           r"Fetch it, or name another ref"):
        regress.resolve_ref(repo, "no-such-ref")
    with pytest.raises(RegressError, match="no base ref given"):
        regress.resolve_ref(repo, "")
    assert regress.resolve_ref(repo, "HEAD") == _git(repo, "rev-parse", "HEAD")


def test_a_shallow_clone_missing_the_ref_says_to_unshallow(repo: Path, tmp_path_factory):
    (repo / "host" / "x.py").write_text("")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "two")
    first = _git(repo, "rev-parse", "HEAD~1")
    clone = tmp_path_factory.mktemp("shallow") / "c"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)],
                   check=True, capture_output=True)
    with pytest.raises(RegressError, match="shallow: `git fetch --unshallow`"):
        regress.resolve_ref(clone, first)


def test_the_base_imports_the_refs_own_package_and_leaves_no_worktree(repo: Path):
    (repo / "host" / "__init__.py").write_text("WHO = 'base'\n")
    _git(repo, "commit", "-qam", "base marker")
    (repo / "host" / "__init__.py").write_text("WHO = 'uncommitted'\n")
    with regress.base_checkout(repo, "HEAD") as base:
        assert base.root != repo.resolve() and (base.root / "pyproject.toml").is_file()
        out = subprocess.run(
            [sys.executable, "-c", "import epick, epick.conformance as c; "
                                   "print(epick.WHO, c.WHO, epick.__file__)"],
            env=base.env, cwd=base.root, capture_output=True, text=True, check=True).stdout
        who, conf, where = out.split()
        assert (who, conf) == ("base", "conformance")
        assert Path(where).resolve().is_relative_to(base.root)
        checkout = base.root
    assert not checkout.exists()
    assert str(checkout) not in _git(repo, "worktree", "list")


def test_a_ref_without_an_epick_package_is_refused(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(RegressError, match="maps no 'epick' package"):
        regress.link_package(tmp_path, tmp_path / "shim")


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(SystemExit):
        regress.main(["--base", "HEAD", "--sizes", "8,x"])


def test_a_short_real_run_prints_a_ratio_line():
    """Both sides really run (HEAD as the base): the output has the ratio line per size."""
    done = subprocess.run(
        [sys.executable, "-m", "epick.cli", "bench", "regress", "--base", "HEAD",
         "--sizes", "4", "--rounds", "1", "--picks", "100"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "alternation 1, 4 endpoints: base " in done.stdout
    line = [x for x in done.stdout.splitlines() if x.startswith("4 endpoints: ")]
    assert len(line) == 1 and "ratio tree ÷ base " in line[0], done.stdout


def test_a_missing_base_ref_fails_the_cli_without_measuring():
    done = subprocess.run(
        [sys.executable, "-m", "epick.cli", "bench", "regress", "--base", "no-such-ref-xyz",
         "--fail-above", "1.15"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "base ref 'no-such-ref-xyz' is not a commit" in done.stderr
    assert "ratio" not in done.stdout


def test_the_accepted_base_is_a_commit_this_history_contains():
    """`make test-perf` reads host/bench/PERF_BASE: one commit id, an ancestor of HEAD."""
    done = subprocess.run(["make", "-s", "-n", "test-perf"], cwd=REPO, capture_output=True,
                          text=True, check=True)
    base = done.stdout.split('--base "', 1)[1].split('"', 1)[0]
    assert len(base) == 40, done.stdout
    subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", base, "HEAD"],
                   check=True)


# --- interleaved mode: its arithmetic, its verdict, its worker's contract -----------------


def _binom_le(n: int, k: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


def test_the_medians_interval_is_the_sign_tests_order_statistics():
    xs = [float(i) for i in range(1, 101)]  # shuffled order must not matter
    lo, hi = regress.median_ci(list(reversed(xs)), 0.99)
    k = int(lo)  # lo is x_(k)
    assert hi == xs[100 - k]
    # k is the largest with P(B <= k-1) <= 0.005: one more would break it.
    assert _binom_le(100, k - 1) <= 0.005 < _binom_le(100, k)
    # Ten values at 99%: only the extremes qualify (P(B <= 0) = 1/1024).
    assert regress.median_ci([5, 1, 3, 2, 4, 9, 8, 7, 6, 10], 0.99) == (1, 10)
    # Too few for any interval at that confidence.
    assert regress.median_ci([1.0, 2.0, 3.0, 4.0, 5.0], 0.99) is None
    assert regress.median_ci([], 0.99) is None


def test_interleaved_fails_only_when_the_medians_interval_is_above_the_limit():
    clear = [1.3 + 0.01 * (i % 7) for i in range(40)]
    assert regress.interleaved_verdict(clear, 1.15)
    # The same median, but a third of the alternations at or below the limit: not clear.
    mixed = [1.3] * 26 + [1.0] * 14
    assert statistics.median(mixed) > 1.15 and not regress.interleaved_verdict(mixed, 1.15)
    # Noise around 1.0 with a burst of bad turns (a load spike) never fails it.
    assert not regress.interleaved_verdict([1.0] * 90 + [3.0] * 10, 1.15)
    # Fewer than MIN_INTERLEAVED alternations never judge, however bad.
    assert not regress.interleaved_verdict([2.0] * (regress.MIN_INTERLEAVED - 1), 1.15)
    assert regress.interleaved_verdict([2.0] * regress.MIN_INTERLEAVED, 1.15)


def test_an_alternations_ratio_is_the_tree_turns_median_over_the_base_turns():
    got = regress.Interleaved()
    got.add("base", 8, {"wall": [10.0, 11.0, 50.0], "cpu": [9.0, 10.0, 40.0]})
    got.add("tree", 8, {"wall": [12.0, 13.0, 11.0], "cpu": [8.0, 8.0, 80.0]})
    got.add("tree", 8, {"wall": [20.0, 20.0, 20.0], "cpu": [10.0, 10.0, 10.0]})
    got.add("base", 8, {"wall": [10.0, 10.0, 10.0], "cpu": [10.0, 10.0, 10.0]})
    assert got.ratios(8, "wall") == pytest.approx([12 / 11, 2.0])
    assert got.ratios(8, "cpu") == pytest.approx([0.8, 1.0])
    with pytest.raises(RegressError, match="2 tree runs but 3 base runs"):
        got.add("base", 8, {"wall": [1.0], "cpu": [1.0]})  # a turn without its pair
        got.ratios(8, "cpu")


def test_the_interleaved_report_judges_each_size_on_its_own_clock():
    got = regress.Interleaved()
    for _ in range(30):
        got.add("base", 8, {"wall": [100.0], "cpu": [100.0]})
        got.add("tree", 8, {"wall": [100.0], "cpu": [130.0]})  # slower by CPU only
        got.add("base", 64, {"wall": [100.0], "cpu": [100.0]})
        got.add("tree", 64, {"wall": [101.0], "cpu": [101.0]})
    lines, failed = regress.report_interleaved((8, 64), got, "cpu", 1.15)
    assert failed
    assert lines[0].startswith("8 endpoints: base p50 100.0 µs, tree p50 130.0 µs (cpu, 30 "
                               "picks each), ratio tree ÷ base 1.300 (median of 30 alternations")
    assert "wall 1.000" in lines[0] and "REGRESSION" in lines[0]
    assert "REGRESSION" not in lines[1]
    assert not regress.report_interleaved((8, 64), got, "wall", 1.15)[1]


def test_the_pinned_cpu_is_one_this_process_may_use():
    assert regress.pin_cpu("auto", {0, 1, 3}) == 3
    assert regress.pin_cpu("none", {0, 1}) is None
    assert regress.pin_cpu("1", {0, 1}) == 1
    with pytest.raises(RegressError, match="not one of this process's CPUs"):
        regress.pin_cpu("5", {0, 1})
    with pytest.raises(RegressError, match="expected auto, none or a CPU number"):
        regress.pin_cpu("fast", {0, 1})


def test_the_worker_speaks_run_n_and_quit():
    assert regress_worker.parse_command("run 100\n") == 100
    assert regress_worker.parse_command("quit\n") is None
    assert regress_worker.parse_command("") is None  # the guard went away: stop
    for bad in ("run 0", "run -3", "run x", "go 5", "run 5 6"):
        with pytest.raises(ValueError, match="bad command"):
            regress_worker.parse_command(bad)


def test_the_worker_imports_no_epick_at_module_level():
    """Its source runs in the base's environment: only what the workload has always had,
    imported inside functions (a module-level import of a new module breaks old bases)."""
    tree = ast.parse(Path(regress_worker.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "epick" for a in node.names)
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "epick"


@pytest.mark.parametrize(("argv", "mode"), [
    ([], "interleaved"),
    (["--rounds", "3"], "runs"),
    (["--picks", "500"], "runs"),
    (["--mode", "interleaved", "--rounds", "3"], "interleaved"),
    (["--mode", "runs"], "runs"),
])
def test_the_old_flags_keep_the_old_mode(monkeypatch, argv, mode):
    """`--rounds`/`--picks` (make test-perf's old line, scripts) still mean whole runs."""
    seen = []

    @contextlib.contextmanager
    def fake_base(root, ref):
        yield regress.Side("base", root, {})

    monkeypatch.setattr(regress, "base_checkout", fake_base)
    monkeypatch.setattr(regress, "preflight", lambda side: None)
    monkeypatch.setattr(regress, "run", lambda *a, **k: seen.append("runs") or regress.Sizes(
        {("tree", 8): [1.0] * 3, ("base", 8): [1.0] * 3}))
    monkeypatch.setattr(regress, "run_interleaved", lambda *a, **k: seen.append(
        "interleaved") or regress.Interleaved({(s, 8, c): [[1.0]] * 10 for s in ("tree", "base")
                                               for c in ("cpu", "wall")}))
    assert regress.main(["--base", "HEAD", "--sizes", "8", *argv]) == 0
    assert seen == [mode]


def test_a_short_interleaved_run_pins_both_sides_and_prints_a_ratio_line():
    """Both workers really run (HEAD as the base), pinned to one CPU, taking turns."""
    cpu = max(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-m", "epick.cli", "bench", "regress", "--base", "HEAD",
         "--sizes", "4", "--turns", "2", "--turn-picks", "20", "--warm", "20",
         "--cpu", str(cpu), "--fail-above", "1.15"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"2 alternations × 20 picks a turn, both pinned to CPU {cpu}" in done.stdout
    line = [x for x in done.stdout.splitlines() if x.startswith("4 endpoints: ")]
    assert len(line) == 1 and "ratio tree ÷ base " in line[0], done.stdout
    assert "(cpu, 40 picks each)" in line[0] and "median of 2 alternations" in line[0]
    assert "verdict: not judged (--turns 2 < 10)" in done.stdout


def test_a_worker_that_dies_is_a_clear_error_and_stray_output_is_skipped(tmp_path: Path):
    """The guard reads only the worker's JSON lines; a worker that exits is named."""
    side = regress.Side("base", tmp_path, dict(os.environ))
    w = regress._Worker.__new__(regress._Worker)
    w.side = side
    w.err = open(tmp_path / "err", "w+")  # noqa: SIM115 (closed below)
    w.proc = subprocess.Popen(
        [sys.executable, "-c", "print('a log line'); print('{\"ready\": 1}'); "
                               "import sys; sys.stderr.write('boom'); sys.exit(3)"],
        stdout=subprocess.PIPE, stderr=w.err, text=True)
    try:
        assert w._read() == {"ready": 1}
        with pytest.raises(RegressError, match=r"base: the interleaved worker stopped "
                                               r"\(exit 3\): boom"):
            w._read()
    finally:
        w.err.close()


def test_a_worker_importing_another_checkouts_epick_is_refused(tmp_path: Path):
    elsewhere = tmp_path / "other" / "host" / "__init__.py"
    side = regress.Side("base", tmp_path / "base", dict(os.environ))
    (tmp_path / "base").mkdir()
    w = regress._Worker.__new__(regress._Worker)
    w.side = side
    w.err = open(tmp_path / "err", "w+")  # noqa: SIM115 (closed below)
    line = json.dumps({"ready": {"epick": str(elsewhere)}})
    w.proc = subprocess.Popen([sys.executable, "-c", f"print({line!r})"],
                              stdout=subprocess.PIPE, stderr=w.err, text=True)
    try:
        with pytest.raises(RegressError, match="the interleaved worker imports epick from"):
            w.ready()
    finally:
        w.proc.wait()
        w.err.close()
