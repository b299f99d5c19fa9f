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

**Interleaved mode** (``--mode interleaved``, the default unless ``--rounds`` or
``--picks`` is given): whole runs a minute apart meet different loads on a shared
machine, so instead one warm process per side (``regress_worker.py``'s source, run in that
side's environment: the same service, pages and requests as ``epick.bench.answer``) is
pinned to the same CPU and the two take turns, ``--turn-picks`` picks each, for
``--turns`` alternations (base first in even ones, tree first in odd ones); one side waits
blocked while the other runs. Each alternation's ratio is the tree turn's p50 ÷ the base
turn's (thread CPU time by default: preemption by other work does not count; ``--clock
wall`` for wall time); the figure is their median, with the spread (p10–p90) and a
distribution-free 99% confidence interval of that median (sign test). ``--fail-above X``
fails only when that interval lies wholly above X: a clear regression, not a noisy turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
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
    "base_checkout", "tree_side", "run", "main", "median_ci", "interleaved_verdict",
    "Interleaved", "run_interleaved", "pin_cpu",
]

#: Fewer alternations than this never fail the check: three in a row is "clear".
MIN_ALTERNATIONS = 3
#: Interleaved mode judges nothing with fewer alternations than this.
MIN_INTERLEAVED = 10
#: The confidence of the median's interval that interleaved mode's verdict uses.
CONFIDENCE = 0.99
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


# --- interleaved mode ---------------------------------------------------------------


def median_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free ``confidence`` interval of the median of ``values`` (order
    statistics, the sign test's binomial): ``(x_(k), x_(n-k+1))`` for the largest k with
    P(Binomial(n, ½) ≤ k−1) ≤ (1−confidence)/2; None when n is too small for any."""
    xs = sorted(values)
    n = len(xs)
    tail = (1.0 - confidence) / 2
    k, below = 0, 0.0  # below = P(B <= k-1)
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2.0 ** n
        if nxt > tail:
            break
        below, k = nxt, k + 1
    if k == 0:
        return None
    return xs[k - 1], xs[n - k]


def interleaved_verdict(ratios: Sequence[float], fail_above: float,
                        confidence: float = CONFIDENCE) -> bool:
    """True (a clear regression) when there are at least :data:`MIN_INTERLEAVED`
    alternations and the median's ``confidence`` interval lies wholly above ``fail_above``."""
    if len(ratios) < MIN_INTERLEAVED:
        return False
    ci = median_ci(ratios, confidence)
    return ci is not None and ci[0] > fail_above


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass
class Interleaved:
    """Per size: each alternation's turns, µs per pick, by side and clock."""

    turns: dict[tuple[str, int, str], list[list[float]]] = field(default_factory=dict)

    def add(self, side: str, size: int, reply: dict[str, list[float]]) -> None:
        for clock in ("wall", "cpu"):
            self.turns.setdefault((side, size, clock), []).append(list(reply[clock]))

    def of(self, side: str, size: int, clock: str) -> list[list[float]]:
        return self.turns.get((side, size, clock), [])

    def ratios(self, size: int, clock: str) -> list[float]:
        """One ratio per alternation: the tree turn's p50 ÷ the base turn's."""
        return alternation_ratios([statistics.median(t) for t in self.of("tree", size, clock)],
                                  [statistics.median(b) for b in self.of("base", size, clock)])


def pin_cpu(choice: str, allowed: set[int] | None = None) -> int | None:
    """The CPU both sides are pinned to: ``auto`` the highest this process may use (CPU 0
    takes more of the machine's interrupts), ``none`` unpinned, or a number it may use."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    if choice == "none":
        return None
    if choice == "auto":
        return max(allowed)
    try:
        cpu = int(choice)
    except ValueError:
        raise RegressError(f"--cpu: expected auto, none or a CPU number, got {choice!r}") from None
    if cpu not in allowed:
        raise RegressError(f"--cpu {cpu}: not one of this process's CPUs {sorted(allowed)}")
    return cpu


class _Worker:
    """One side's warm process (``regress_worker.py``'s source run with ``python -c``)."""

    def __init__(self, side: Side, endpoints: int, warm: int, cpu: int | None,
                 python: str = sys.executable) -> None:
        self.side = side
        src = Path(__file__).with_name("regress_worker.py").read_text()
        cmd = [python, "-c", src, "--endpoints", str(endpoints), "--warm", str(warm)]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=side.env, cwd=side.root, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True)

    def _read(self) -> dict:
        """The worker's next JSON line (anything else a side prints on stdout is skipped)."""
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    got = json.loads(line)
                    if isinstance(got, dict):
                        return got
        self.proc.wait(timeout=30)
        self.err.seek(0)
        raise RegressError(f"{self.side.name}: the interleaved worker stopped "
                           f"(exit {self.proc.returncode}): {self.err.read().strip()[-800:]}")

    def ready(self) -> dict:
        """The worker's ready line, checked: it imports its own side's epick."""
        info = self._read()["ready"]
        where = Path(info["epick"]).resolve()
        if not where.is_relative_to(self.side.root):
            raise RegressError(f"{self.side.name}: the interleaved worker imports epick from "
                               f"{where}, not from {self.side.root}")
        return info

    def turn(self, picks: int) -> dict[str, list[float]]:
        self.proc.stdin.write(f"run {picks}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def run_interleaved(tree: Side, base: Side, sizes: Sequence[int], turns: int,
                    turn_picks: int, *, cpu: int | None, warm: int = 1000,
                    clock: str = "cpu", log=print) -> Interleaved:
    """Per size, one warm worker per side on the same CPU, taking turns."""
    out = Interleaved()
    for n in sizes:
        workers = {s.name: _Worker(s, n, warm, cpu) for s in (base, tree)}
        try:
            for w in workers.values():
                w.ready()
            for k in range(turns):
                order = ("base", "tree") if k % 2 == 0 else ("tree", "base")
                for name in order:
                    out.add(name, n, workers[name].turn(turn_picks))
                if (k + 1) % 20 == 0 or k + 1 == turns:
                    done = out.ratios(n, clock)
                    log(f"  {n} endpoints: {k + 1} alternations, median ratio so far "
                        f"{statistics.median(done):.3f} ({clock})")
        finally:
            for w in workers.values():
                w.close()
    return out


def report_interleaved(sizes: Sequence[int], got: Interleaved, clock: str,
                       fail_above: float | None) -> tuple[list[str], bool]:
    """The result lines (ratio, spread, the median's interval) and whether the check failed."""
    lines, failed = [], False
    other = "wall" if clock == "cpu" else "cpu"
    for n in sizes:
        per = got.ratios(n, clock)
        tree = [x for t in got.of("tree", n, clock) for x in t]
        base = [x for t in got.of("base", n, clock) for x in t]
        ci = median_ci(per)
        ci_text = (f"{CONFIDENCE:.0%} CI of the median {ci[0]:.3f}–{ci[1]:.3f}" if ci
                   else "too few alternations for a CI")
        line = (f"{n} endpoints: base p50 {statistics.median(base):.1f} µs, tree p50 "
                f"{statistics.median(tree):.1f} µs ({clock}, {len(base)} picks each), "
                f"ratio tree ÷ base {statistics.median(per):.3f} (median of {len(per)} "
                f"alternations; p10–p90 {_quantile(per, 0.1):.2f}–{_quantile(per, 0.9):.2f}, "
                f"{ci_text}; {other} {statistics.median(got.ratios(n, other)):.3f})")
        if fail_above is not None and interleaved_verdict(per, fail_above):
            failed = True
            line += f" — REGRESSION: the median's interval is above {fail_above}"
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
    ap.add_argument("--mode", choices=("interleaved", "runs"), default=None,
                    help="interleaved (default): two warm processes pinned to one CPU taking "
                         "turns; runs: whole workload runs alternated (the default when "
                         "--rounds or --picks is given)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="runs mode: alternations of base and tree (3; fewer never fail "
                         "the check)")
    ap.add_argument("--picks", type=int, default=None,
                    help="runs mode: timed picks per run, twice (2000; the workload's "
                         "--picks, --rounds 2)")
    ap.add_argument("--turns", type=int, default=100,
                    help="interleaved mode: alternations of turns per size (100; fewer than "
                         f"{MIN_INTERLEAVED} never fail the check)")
    ap.add_argument("--turn-picks", type=int, default=100,
                    help="interleaved mode: timed picks per turn (100)")
    ap.add_argument("--warm", type=int, default=1000,
                    help="interleaved mode: untimed picks per side before the first turn")
    ap.add_argument("--cpu", default="auto",
                    help="interleaved mode: the CPU both sides are pinned to (auto: the "
                         "highest this process may use; none: unpinned)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="interleaved mode: the ratio's clock (cpu: the thread's CPU time)")
    ap.add_argument("--fail-above", type=float, default=None, metavar="RATIO",
                    help="exit 1 on a clear regression above RATIO: runs mode, every "
                         "alternation above it (needs --rounds >= 3); interleaved mode, the "
                         f"median's {CONFIDENCE:.0%}% interval wholly above it")
    args = ap.parse_args(argv)
    mode = args.mode or ("runs" if args.rounds is not None or args.picks is not None
                         else "interleaved")
    rounds = 3 if args.rounds is None else args.rounds
    picks = 2000 if args.picks is None else args.picks
    if rounds < 1 or picks < 1:
        ap.error("--rounds and --picks must be >= 1")
    if args.turns < 1 or args.turn_picks < 1 or args.warm < 0:
        ap.error("--turns and --turn-picks must be >= 1, --warm >= 0")
    try:
        cpu = pin_cpu(args.cpu) if mode == "interleaved" else None
        tree = tree_side()
        with base_checkout(tree.root, args.base) as base:
            for side in (tree, base):
                preflight(side)
            commit = _git(tree.root, "rev-parse", "--short", "HEAD^{commit}")
            dirty = " + uncommitted changes" if _git(tree.root, "status", "--porcelain",
                                                     "--untracked-files=no") else ""
            head = (f"epick bench regress: tree {tree.root} ({commit}{dirty}) vs base "
                    f"{args.base} ({_git(tree.root, 'rev-parse', '--short', args.base + '^{commit}')}"
                    "), answer_pick in process, ")
            if mode == "runs":
                print(head + f"{rounds} alternation(s) × {2 * picks} picks", flush=True)
                got = run(tree, base, args.sizes, rounds, picks,
                          log=lambda s: print(s, flush=True))
            else:
                where = "unpinned" if cpu is None else f"both pinned to CPU {cpu}"
                print(head + f"interleaved: {args.turns} alternations × {args.turn_picks} "
                      f"picks a turn, {where}", flush=True)
                inter = run_interleaved(tree, base, args.sizes, args.turns, args.turn_picks,
                                        cpu=cpu, warm=args.warm, clock=args.clock,
                                        log=lambda s: print(s, flush=True))
    except RegressError as e:
        print(f"epick bench regress: {e}", file=sys.stderr)
        return 2
    if mode == "runs":
        lines, failed = report(args.sizes, got, args.fail_above)
    else:
        lines, failed = report_interleaved(args.sizes, inter, args.clock, args.fail_above)
    for line in lines:
        print(line)
    if args.fail_above is not None:
        if mode == "runs" and rounds < MIN_ALTERNATIONS:
            print(f"verdict: not judged (--rounds {rounds} < {MIN_ALTERNATIONS})")
        elif mode == "interleaved" and args.turns < MIN_INTERLEAVED:
            print(f"verdict: not judged (--turns {args.turns} < {MIN_INTERLEAVED})")
        elif mode == "runs":
            print("verdict: " + ("REGRESSION" if failed else
                                 f"ok (no size above {args.fail_above} in every alternation)"))
        else:
            print("verdict: " + ("REGRESSION" if failed else
                                 f"ok (no size's median {CONFIDENCE:.0%} interval wholly above "
                                 f"{args.fail_above})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
