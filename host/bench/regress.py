"""`epick bench regress --base REF`: the pick path's cost, this working tree ÷ a git ref.

Runs the same in-process workload — ``python -m epick.bench.answer``: the real service's
``answer_pick`` (validation, the three default WASM policies, picker, hooks, decision
memory, telemetry, encoding; no gRPC) — once per side, size and alternation, each run
in its own subprocess:

- **tree**: this interpreter importing the ``epick`` it runs now (the working tree,
  uncommitted edits included);
- **base**: the same interpreter importing ``REF``'s ``epick`` from a clean ``git
  worktree add --detach`` of it in a temporary folder, put first on ``PYTHONPATH`` through
  a folder holding an ``epick`` link (the ref's own ``pyproject.toml`` says which folders
  make the package). Nothing is built: the ref's committed host code and ``.wasm`` files
  are what is measured; a preflight asks the ref's own ``epick.config.BUILTIN_POLICY_DIR``
  and refuses to measure if either side imports code from the wrong place.

Alternations run base then tree, then tree then base, … so drift on a shared machine hits
both alike. It prints each side's median p50 per size and the ratio tree ÷ base (the median of the
alternations' own ratios, each a back-to-back pair); with
``--fail-above X`` it exits 1 when, for some size, *every* alternation's ratio is above
X (and there are at least three): one noisy alternation cannot fail it.

The workload is a CLI entry rather than a driver importing epick's classes so that it
survives refactors: ``python -m epick.bench.answer --endpoints/--picks/--rounds`` and its
``p50 … µs`` line exist on both sides, whatever the host's modules are called.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "RegressError", "Side", "Sizes", "parse_p50", "ratio", "verdict", "resolve_ref",
    "base_checkout", "tree_side", "run", "main",
]

#: Fewer alternations than this never fail the check: three in a row is "clear".
MIN_ALTERNATIONS = 3
#: The built-ins the workload loads; the preflight checks each side has them.
WORKLOAD_POLICIES = ("load", "prefix-cache", "lora-affinity")

_P50 = re.compile(r"\bp50 ([0-9]+(?:\.[0-9]+)?) µs")


class RegressError(Exception):
    """The guard cannot measure (bad ref, wrong code imported, workload failed)."""


@dataclass(frozen=True)
class Side:
    """One side of the comparison: a name, the checkout it must import, its environment."""

    name: str
    root: Path
    env: dict[str, str]


@dataclass
class Sizes:
    """p50 per run, per side and size, in alternation order."""

    samples: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def add(self, side: str, size: int, p50: float) -> None:
        self.samples.setdefault((side, size), []).append(p50)

    def of(self, side: str, size: int) -> list[float]:
        return self.samples.get((side, size), [])


def parse_p50(output: str) -> float:
    """The p50 in µs from ``python -m epick.bench.answer``'s report line."""
    found = _P50.findall(output)
    if len(found) != 1:
        raise RegressError("the workload's output has no single 'p50 N µs' figure: "
                           f"{output.strip()[-300:]!r}")
    return float(found[0])


def ratio(tree: float, base: float) -> float:
    """tree ÷ base (> 1: the tree is slower)."""
    if base <= 0:
        raise RegressError(f"base p50 must be positive, got {base}")
    return tree / base


def alternation_ratios(tree: Sequence[float], base: Sequence[float]) -> list[float]:
    """One ratio per alternation: its tree run ÷ its base run."""
    if len(tree) != len(base):
        raise RegressError(f"{len(tree)} tree runs but {len(base)} base runs")
    return [ratio(t, b) for t, b in zip(tree, base, strict=True)]


def verdict(ratios: Sequence[float], fail_above: float) -> bool:
    """True (a clear regression) when every alternation is above ``fail_above`` and there
    are at least :data:`MIN_ALTERNATIONS` of them."""
    return len(ratios) >= MIN_ALTERNATIONS and all(r > fail_above for r in ratios)


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode:
        raise RegressError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve_ref(repo: Path, ref: str) -> str:
    """``ref``'s commit id in ``repo``, or a :class:`RegressError` saying why not."""
    if not ref.strip():
        raise RegressError("no base ref given (--base REF: a commit, tag or branch)")
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet",
                           f"{ref}^{{commit}}"], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip()
    shallow = subprocess.run(["git", "-C", str(repo), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip() == "true"
    hint = (" This clone is shallow: `git fetch --unshallow` (or clone without --depth)."
            if shallow else " Fetch it, or name another ref.")
    raise RegressError(f"base ref {ref!r} is not a commit in {repo}.{hint}")


def tree_side() -> Side:
    """The checkout this ``epick`` is imported from (it must be a git checkout)."""
    import epick

    root = Path(epick.__file__).resolve().parent.parent
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                          capture_output=True, text=True)
    if done.returncode or Path(done.stdout.strip()).resolve() != root:
        raise RegressError(f"epick is imported from {root}, which is not a git checkout's "
                           "root; run the guard from a checkout's venv (make install)")
    # The same environment as this process: its runs import what this one imported
    # (the preflight checks that they do).
    return Side("tree", root, dict(os.environ))


def link_package(checkout: Path, shim: Path) -> None:
    """Make ``shim/epick`` import ``checkout``'s package as its ``pyproject.toml`` maps it.

    ``package-dir`` maps ``epick`` to a folder (``host``) and may map subpackages to
    others (``epick.conformance`` = ``conformance``); each subpackage gets a link inside
    the checkout's package folder (a throwaway worktree), so plain path imports find it.
    """
    meta = tomllib.loads((checkout / "pyproject.toml").read_text())
    dirs = meta.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    if "epick" not in dirs:
        raise RegressError(f"{checkout}/pyproject.toml maps no 'epick' package "
                           "([tool.setuptools.package-dir])")
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "epick").symlink_to(checkout / dirs["epick"], target_is_directory=True)
    for name, folder in sorted(dirs.items()):
        if name == "epick" or not name.startswith("epick."):
            continue
        link = checkout / dirs["epick"] / Path(*name.split(".")[1:])
        if not link.exists():
            link.symlink_to(checkout / folder, target_is_directory=True)


@contextlib.contextmanager
def base_checkout(repo: Path, ref: str) -> Iterator[Side]:
    """A clean detached worktree of ``ref`` and the environment that imports it."""
    commit = resolve_ref(repo, ref)
    tmp = Path(tempfile.mkdtemp(prefix="epick-regress-"))
    checkout = tmp / "base"
    try:
        _git(repo, "worktree", "add", "--detach", "--quiet", str(checkout), commit)
        link_package(checkout, tmp / "path")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(tmp / "path")
        yield Side("base", checkout.resolve(), env)
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(checkout)],
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


_PREFLIGHT = """
import json, epick, epick.config, epick.bench.answer
d = getattr(epick.config, "BUILTIN_POLICY_DIR", None)
print(json.dumps({"epick": epick.__file__, "answer": epick.bench.answer.__file__,
                  "builtin": None if d is None else str(d)}))
"""


def preflight(side: Side, python: str = sys.executable) -> Path:
    """Check ``side`` imports its own epick and has its built-in .wasm; returns their dir."""
    done = subprocess.run([python, "-c", _PREFLIGHT], env=side.env, cwd=side.root,
                          capture_output=True, text=True)
    if done.returncode:
        if "No module named 'epick.bench.answer'" in done.stderr:
            raise RegressError(f"{side.name} ({side.root}) has no `python -m epick.bench."
                               "answer`, the workload (added in cb0583f): name a later base")
        raise RegressError(f"{side.name} ({side.root}): cannot import its epick: "
                           f"{done.stderr.strip()[-500:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    for what in ("epick", "answer"):
        where = Path(info[what]).resolve()
        if not where.is_relative_to(side.root):
            raise RegressError(f"{side.name}: {what} is imported from {where}, not from "
                               f"{side.root}; the guard would measure the wrong code")
    if info["builtin"] is None:
        raise RegressError(f"{side.name}: its epick.config has no BUILTIN_POLICY_DIR")
    builtin = Path(info["builtin"]).resolve()
    missing = [p for p in WORKLOAD_POLICIES if not (builtin / f"{p}.wasm").is_file()]
    if not builtin.is_relative_to(side.root) or missing:
        raise RegressError(f"{side.name}: built-in policies {missing or list(WORKLOAD_POLICIES)}"
                           f" not found in its checkout (BUILTIN_POLICY_DIR = {builtin})")
    return builtin


def measure(side: Side, endpoints: int, picks: int, python: str = sys.executable) -> float:
    """One workload run on ``side``: p50 µs of ``answer_pick`` at ``endpoints``."""
    cmd = [python, "-m", "epick.bench.answer", "--endpoints", str(endpoints),
           "--picks", str(picks), "--rounds", "2"]
    done = subprocess.run(cmd, env=side.env, cwd=side.root, capture_output=True, text=True,
                          timeout=300)
    if done.returncode:
        raise RegressError(f"{side.name}: {' '.join(cmd[1:])} failed: "
                           f"{done.stderr.strip()[-800:]}")
    return parse_p50(done.stdout)


def run(tree: Side, base: Side, sizes: Sequence[int], alternations: int, picks: int,
        *, log=print) -> Sizes:
    """Alternate base and tree: base first in even alternations, tree first in odd ones."""
    out = Sizes()
    for k in range(alternations):
        order = (base, tree) if k % 2 == 0 else (tree, base)
        for n in sizes:
            figures = []
            for side in order:
                p50 = measure(side, n, picks)
                out.add(side.name, n, p50)
                figures.append(f"{side.name} {p50:.1f}")
            log(f"  alternation {k + 1}, {n} endpoints: {', '.join(figures)} µs p50")
    return out


def report(sizes: Sequence[int], got: Sizes, fail_above: float | None) -> tuple[list[str], bool]:
    """The result lines and whether the check failed."""
    lines, failed = [], False
    for n in sizes:
        tree, base = got.of("tree", n), got.of("base", n)
        per = alternation_ratios(tree, base)
        mt, mb = statistics.median(tree), statistics.median(base)
        # The ratio is the median of the paired ratios: each pair ran back to back, so
        # it cancels drift that the two sides' medians, taken apart, would keep.
        line = (f"{n} endpoints: base p50 {mb:.1f} µs, tree p50 {mt:.1f} µs (medians), "
                f"ratio tree ÷ base {statistics.median(per):.3f} "
                f"(per alternation {' '.join(f'{r:.2f}' for r in per)})")
        if fail_above is not None and verdict(per, fail_above):
            failed = True
            line += f" — REGRESSION: every alternation above {fail_above}"
        lines.append(line)
    return lines, failed


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: expected endpoint counts like 8,64, "
                                         f"got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes: counts must be >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench regress", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True,
                    help="the git ref to compare with (commit, tag, branch, HEAD~3)")
    ap.add_argument("--sizes", type=_sizes, default=(8, 64), help="endpoint counts (8,64)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternations of base and tree (3; fewer never fail the check)")
    ap.add_argument("--picks", type=int, default=2000,
                    help="timed picks per run, twice (the workload's --picks, --rounds 2)")
    ap.add_argument("--fail-above", type=float, default=None, metavar="RATIO",
                    help="exit 1 if, at some size, every alternation's tree ÷ base is "
                         "above RATIO (needs --rounds >= 3)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.picks < 1:
        ap.error("--rounds and --picks must be >= 1")
    try:
        tree = tree_side()
        with base_checkout(tree.root, args.base) as base:
            for side in (tree, base):
                preflight(side)
            commit = _git(tree.root, "rev-parse", "--short", "HEAD^{commit}")
            dirty = " + uncommitted changes" if _git(tree.root, "status", "--porcelain",
                                                     "--untracked-files=no") else ""
            print(f"epick bench regress: tree {tree.root} ({commit}{dirty}) vs base "
                  f"{args.base} ({_git(tree.root, 'rev-parse', '--short', args.base + '^{commit}')}"
                  f"), answer_pick in process, {args.rounds} alternation(s) × "
                  f"{2 * args.picks} picks", flush=True)
            got = run(tree, base, args.sizes, args.rounds, args.picks,
                      log=lambda s: print(s, flush=True))
    except RegressError as e:
        print(f"epick bench regress: {e}", file=sys.stderr)
        return 2
    lines, failed = report(args.sizes, got, args.fail_above)
    for line in lines:
        print(line)
    if args.fail_above is not None:
        if args.rounds < MIN_ALTERNATIONS:
            print(f"verdict: not judged (--rounds {args.rounds} < {MIN_ALTERNATIONS})")
        else:
            print("verdict: " + ("REGRESSION" if failed else
                                 f"ok (no size above {args.fail_above} in every alternation)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
