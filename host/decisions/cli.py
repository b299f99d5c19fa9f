"""`epick replay`: run a decision log through the live policy set with changes.

    epick replay LOG [LOG...] [--policy NAME=FILE.wasm]... [--weights NAME=W,...]
                 [--params NAME=JSON]... [--modules DIR]... [--json] [--top N]
                 [--min-agreement X]

Exit status: 0 when the agreement with the recorded picks is at least ``--min-agreement``
(default 0), 1 below it, 2 when the replay cannot run (bad log, missing module, bad
argument) — the message names the file, the policy or the argument.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import msgspec

from epick.decisions.reader import LogError
from epick.decisions.replay import Changes, ReplayError, ReplayReport, replay

__all__ = ["main", "parse_changes", "render"]


class ArgumentError(ValueError):
    """A command-line value is malformed; the message names the option and the value."""


def _name_value(option: str, text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise ArgumentError(f"{option} {text!r}: expected NAME=VALUE")
    return name.strip(), value.strip()


def parse_changes(policies: list[str], weights: list[str], params: list[str]) -> Changes:
    """Turn the command-line options into :class:`Changes` (ArgumentError if malformed)."""
    ch = Changes()
    for text in policies:
        name, file = _name_value("--policy", text)
        path = Path(file).expanduser()
        try:
            ch.modules[name] = (path.read_bytes(), str(path))
        except OSError as exc:
            raise ArgumentError(f"--policy {text!r}: cannot read {path}: {exc.strerror}") from None
    for group in weights:
        for text in group.split(","):
            name, value = _name_value("--weights", text)
            try:
                w = float(value)
            except ValueError:
                raise ArgumentError(f"--weights {text!r}: {value!r} is not a number") from None
            if not w >= 0 or w == float("inf"):
                raise ArgumentError(f"--weights {text!r}: a weight must be finite and >= 0")
            ch.weights[name] = w
    for text in params:
        name, value = _name_value("--params", text)
        try:
            p = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ArgumentError(f"--params {text!r}: not JSON: {exc.msg}") from None
        if not isinstance(p, dict):
            raise ArgumentError(f"--params {text!r}: expected a JSON object, e.g. "
                                f"{name}={{\"profile\": \"upstream\"}}")
        ch.params.setdefault(name, {}).update(p)
    return ch


def _modules(dirs: list[str]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for d in dirs:
        folder = Path(d).expanduser()
        if not folder.is_dir():
            raise ArgumentError(f"--modules {d!r}: not a folder")
        for p in sorted(folder.glob("*.wasm")):
            data = p.read_bytes()
            out[hashlib.sha256(data).hexdigest()] = data
    return out


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def render(r: ReplayReport, console) -> None:
    """The report as readable tables."""
    from rich.table import Table

    console.print(f"[bold]replay[/bold] of {len(r.files)} file(s): {r.decisions} decisions, "
                  f"{r.completions} completions in {r.seconds:.2f} s "
                  f"({r.decisions_per_s:,.0f} decisions/s)")
    console.print(f"  recorded: {', '.join(r.recorded_policies)}")
    console.print(f"  replayed: {', '.join(r.replayed_policies)}")
    console.print(f"[bold]agreement[/bold] {r.agreement:.2%} ({r.agreed}/{r.decisions} "
                  f"same primary; {r.fallbacks_agreed} with the same fallbacks too)")
    notes = []
    if r.cold_start:
        notes.append("the log starts mid-run: policy state before it is unknown, so early "
                     "decisions may differ")
    if r.restarts:
        notes.append(f"{r.restarts} service restart(s) in the log (policies start fresh)")
    if r.lost_records:
        notes.append(f"{r.lost_records} record(s) were dropped by the live writer")
    if r.live_recoveries:
        notes.append(f"{r.live_recoveries} live policy re-creation(s) after a trap or "
                     "timeout (state back to its checkpoint), mirrored in the replay")
    if r.live_failures:
        notes.append(f"{r.live_failures} decision(s) had a live policy failure, mirrored "
                     "for unchanged policies")
    if r.replay_failed:
        notes.append(f"the replay refused {r.replay_failed}")
    if r.replay_policy_errors:
        notes.append(f"policy errors in the replay: {r.replay_policy_errors}")
    if r.unknown_completions:
        notes.append(f"{r.unknown_completions} completion(s) matched no replayed decision")
    for n in notes:
        console.print(f"  note: {n}")

    t = Table(title="score deltas (replayed − recorded, per candidate)")
    for c in ("policy", "compared", "changed", "mean |Δ|", "max |Δ|", "mean Δ"):
        t.add_column(c, justify="right")
    for d in r.score_deltas:
        t.add_row(d.policy, str(d.compared), str(d.changed), f"{d.mean_abs:.4f}",
                  f"{d.max_abs:.4f}", f"{d.mean:+.4f}")
    console.print(t)

    t = Table(title="picks per endpoint")
    for c in ("endpoint", "recorded", "replayed", "change"):
        t.add_column(c, justify="right")
    for ep, (a, b) in r.spread.items():
        t.add_row(ep, str(a), str(b), f"{b - a:+d}")
    console.print(t)

    t = Table(title="locality estimates")
    for c in ("", "recorded", "replayed"):
        t.add_column(c, justify="right")
    t.add_row("prefix hit (leading blocks already sent there)", _f(r.prefix_hit_estimate[0]),
              _f(r.prefix_hit_estimate[1]))
    t.add_row("adapter requests picked where it runs", _f(r.adapter_resident[0]),
              _f(r.adapter_resident[1]))
    t.add_row("endpoints per adapter", _f(r.endpoints_per_adapter[0], ".2f"),
              _f(r.endpoints_per_adapter[1], ".2f"))
    console.print(t)

    if r.most_changed:
        t = Table(title="most changed decisions (largest replayed margin first)")
        for c in ("decision", "model/adapter", "recorded → replayed", "margin",
                  "why: policy recorded@rec → replayed@rec | replayed@new"):
            t.add_column(c)
        for c in r.most_changed:
            why = "; ".join(
                f"{k} {_f(v[0])}→{_f(v[1])} | {_f(v[2])}" for k, v in c.why.items())
            t.add_row(c.id, f"{c.model}/{c.adapter or '-'}", f"{c.recorded} → {c.replayed}",
                      _f(c.margin) if c.margin != float("inf") else "filtered", why)
        console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", metavar="LOG",
                    help="a decision log (its rotated files come along) or one rotated file")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=FILE.wasm",
                    help="replace policy NAME's module (or add a policy NAME)")
    ap.add_argument("--weights", action="append", default=[], metavar="NAME=W,...",
                    help="set policies' weights")
    ap.add_argument("--params", action="append", default=[], metavar="NAME=JSON",
                    help="params merged over policy NAME's recorded params")
    ap.add_argument("--modules", action="append", default=[], metavar="DIR",
                    help="a folder of .wasm files to find modules the log does not embed")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--top", type=int, default=10, help="most changed decisions to show")
    ap.add_argument("--min-agreement", type=float, default=0.0, metavar="X",
                    help="exit 1 when agreement is below X (a fraction, e.g. 0.95)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.min_agreement <= 1.0:
        print(f"epick replay: --min-agreement {args.min_agreement}: expected a fraction "
              "in [0, 1], e.g. 0.95", file=sys.stderr)
        return 2
    if args.top < 0:
        print(f"epick replay: --top {args.top}: must be >= 0", file=sys.stderr)
        return 2
    # Mirrored live failures and recoveries would log a warning each; the report counts
    # them (and any error of the replay's own) instead.
    import logging

    quiet = logging.getLogger("epick")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        changes = parse_changes(args.policy, args.weights, args.params)
        modules = _modules(args.modules)
        report = replay(args.logs, changes, top=args.top, modules=modules)
    except (ArgumentError, LogError, ReplayError) as exc:
        print(f"epick replay: {exc}", file=sys.stderr)
        return 2
    finally:
        # Only for the replay: a caller in the same process (a test, a notebook) keeps
        # its warnings.
        quiet.setLevel(level)
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        from rich.console import Console

        render(report, Console(width=160))
    if report.agreement < args.min_agreement:
        print(f"epick replay: agreement {report.agreement:.2%} is below --min-agreement "
              f"{args.min_agreement:.2%}", file=sys.stderr)
        return 1
    return 0
