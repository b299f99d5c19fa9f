"""`epick bench regress`: the guard's arithmetic, its verdict, its refusals, one real run.

Nothing here asserts a timing: the verdict is tested on given ratios, the real run only
for the shape of its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epick.bench import regress
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
