"""``epick conformance MODULE.wasm ...``: run the conformance suite from the command line.

Exit status: 0 every case and property passed; 1 something failed; 2 the run could not
start (unreadable module or params, a bad vector file, params ``init`` refuses).
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from epick.conformance.check import ConformanceError, check
from epick.conformance.report import Report
from epick.conformance.schema import KINDS

__all__ = ["main", "build_parser", "render"]

_STYLE = {"pass": "green", "fail": "bold red", "error": "bold magenta"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="epick conformance",
        description="Check a policy module against its kind's vectors and the ABI properties.",
    )
    ap.add_argument("module", metavar="MODULE.wasm", type=Path, nargs="?",
                    help="the policy module (leave out with --kind host)")
    ap.add_argument(
        "--kind", choices=[*KINDS, "host"],
        help="which vector sets to run (default: the kind the module's describe reports; "
             "host: the host-stage vectors, no module)",
    )
    ap.add_argument(
        "--params", metavar="FILE", type=Path,
        help="the params the module goes live with: a TOML (or .json) table (default: {})",
    )
    ap.add_argument(
        "--vectors", metavar="EXTRA_FILE", type=Path, action="append", default=[],
        help="an extra vector file (repeatable); see conformance/README.md",
    )
    ap.add_argument(
        "--only", action="store_true",
        help="run only the --vectors files, not the built-in vectors of the kind",
    )
    ap.add_argument("--no-properties", action="store_true",
                    help="skip the ABI properties (vectors only)")
    ap.add_argument("--junit", metavar="OUT.xml", type=Path, help="also write a JUnit XML report")
    return ap


def _read_params(path: Path) -> dict:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConformanceError(f"{path}: cannot read params file: {exc.strerror or exc}") from exc
    try:
        params = json.loads(data) if path.suffix == ".json" else tomllib.loads(data.decode())
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError, JSONDecodeError
        raise ConformanceError(f"{path}: not a valid params file: {exc}") from exc
    if not isinstance(params, dict):
        raise ConformanceError(f"{path}: params must be a table, got {type(params).__name__}")
    return params


def render(report: Report, console: Console) -> None:
    """The report as a table (case, expected, got, verdict, why) and a summary line."""
    table = Table(title=f"conformance: {report.module} ({report.kind})", show_lines=False)
    # Fold rather than truncate: a cut-off "why" would hide the one thing people need.
    table.add_column("case", overflow="fold", ratio=2)
    table.add_column("expected", overflow="fold", ratio=2)
    table.add_column("got", overflow="fold", ratio=2)
    table.add_column("verdict", no_wrap=True, min_width=7)
    table.add_column("why", overflow="fold", ratio=5)
    for c in report.cases:
        table.add_row(
            escape(c.name), escape(c.expected), escape(c.got),
            f"[{_STYLE[c.verdict]}]{c.verdict}[/]", escape(c.why),
        )
    console.print(table)
    # Each failure once more in full, unwrapped: the line to paste into a bug report.
    for c in report.failures:
        console.print(
            f"[{_STYLE[c.verdict]}]{c.verdict.upper()}[/] {escape(c.why)}",
            soft_wrap=True, highlight=False,
        )
    style = "bold green" if report.passed else "bold red"
    console.print(f"[{style}]{report.summary()}[/]")


def main(argv: list[str]) -> int:
    """Run the suite; the exit status is 0 only when every case and property passes."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.module is None and args.kind != "host":
        ap.error("MODULE.wasm is required (only --kind host runs without one)")
    if args.only and not args.vectors:
        ap.error("--only runs only the --vectors files: give at least one")
    console = Console()
    if not console.is_terminal:  # piped or in CI: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 160))
    err = Console(stderr=True)
    from epick.runtime import Limits, PolicyError, Runtime  # heavy: wasmtime

    try:
        params = _read_params(args.params) if args.params else {}
        wasm = None
        if args.module is not None:
            try:
                wasm = args.module.read_bytes()
            except OSError as exc:
                raise ConformanceError(
                    f"{args.module}: cannot read module: {exc.strerror or exc}"
                ) from exc
        with Runtime(Limits()) as rt:
            module = rt.compile(wasm, name=args.module.stem) if wasm is not None else None
            report = check(module, params, kind=args.kind, extra_vectors=args.vectors,
                           properties=not args.no_properties, builtin_vectors=not args.only,
                           runtime=rt)
    except (ConformanceError, PolicyError) as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    render(report, console)
    if args.junit:
        report.write_junit(args.junit)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
