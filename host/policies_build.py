"""Build the policies in ``policies/*/`` into ``host/builtin/NAME.wasm``.

Run as ``python -m epick.policies_build`` (``make policies``). The output folder is the
package ``epick.builtin``, so the built modules are package data and a wheel carries them
(``epick.config.BUILTIN_POLICY_DIR``). Each directory under ``policies/`` except ``sdk``
is one policy, named after the directory:

- ``main.zig`` — a Zig policy on the SDK (``policies/sdk/epick.zig``, imported as
  ``epick``), built with ``zig build-exe``. Its exports follow from the hooks it declares
  (:data:`ZIG_HOOK_EXPORTS`), passed as explicit ``--export=`` flags.
- ``*.c`` — a C policy (``#include "epick.h"``), built with ``zig cc``; its exports come
  from ``export_name`` attributes in the source.

Every build targets ``wasm32-freestanding`` with ``ReleaseFast`` (C: ``-O2``), no entry
point, no libc, no WASI, no imports — and is byte-for-byte reproducible: the same
sources and Zig version give the same ``.wasm`` (``--check`` verifies the committed ones).

Usage::

    python -m epick.policies_build [--out DIR] [--check] [NAME ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = ["POLICIES_DIR", "BUILTIN_DIR", "ZIG_VERSION", "Policy", "BuildError", "discover", "check_zig", "build", "build_all", "main"]

#: ``policies/`` of this checkout (host/ and policies/ are siblings).
POLICIES_DIR = Path(__file__).resolve().parent.parent / "policies"

#: Where the built modules go: host/builtin/, the package ``epick.builtin`` (a checkout's;
#: ``make policies`` runs in one).
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"

#: Directories under ``policies/`` that are not policies.
NOT_POLICIES = frozenset({"sdk"})

#: The exports every SDK policy has (policies/sdk/epick.zig, ``exportPolicy``).
ZIG_BASE_EXPORTS = (
    "epick_abi_version",
    "alloc",
    "error_ptr",
    "error_len",
    "output_ptr",
    "output_len",
    "init",
    "describe",
)

#: SDK hook (a ``pub fn`` in the policy's root file) -> the export it adds.
ZIG_HOOK_EXPORTS = {
    "score": "score",
    "filter": "filter",
    "preRequest": "pre_request",
    "postResponse": "post_response",
    "exportState": "export_state",
    "importState": "import_state",
}

#: Linear-memory stack for every policy: the SDK keeps data on the heap, not the stack.
STACK_BYTES = 64 * 1024

#: The Zig the committed modules were built with (pyproject's `ziglang` pin): another
#: version compiles the same sources to different bytes.
ZIG_VERSION = "0.17.1"

_HOOK = re.compile(r"^pub fn (\w+)\(", re.MULTILINE)
_NOT_RESIDENT = re.compile(r"^pub const resident_snapshot\s*=\s*false\s*;", re.MULTILINE)


class BuildError(Exception):
    """A build failed: ``policy`` names the policy (``None``: the toolchain), the message
    carries the compiler's."""

    def __init__(self, policy: str | None, message: str) -> None:
        super().__init__(f"policy {policy!r}: {message}" if policy else message)
        self.policy = policy


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    source_dir: Path
    language: str
    """``zig`` or ``c``."""


def discover(root: Path | None = None) -> list[Policy]:
    """Every policy directory under ``root`` (default :data:`POLICIES_DIR`), sorted by name."""
    root = root or POLICIES_DIR
    found = []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in NOT_POLICIES):
        if (d / "main.zig").is_file():
            found.append(Policy(d.name, d, "zig"))
        elif any(d.glob("*.c")):
            found.append(Policy(d.name, d, "c"))
    return found


def zig_exports(main_zig: Path) -> list[str]:
    """The export names the SDK generates for this policy's hooks."""
    src = main_zig.read_text()
    hooks = set(_HOOK.findall(src))
    exports = list(ZIG_BASE_EXPORTS)
    exports += [exp for hook, exp in ZIG_HOOK_EXPORTS.items() if hook in hooks]
    if not _NOT_RESIDENT.search(src):
        exports.append("set_snapshot")
    return exports


def _zig() -> list[str]:
    return [sys.executable, "-m", "ziglang"]


def _command(policy: Policy, out: Path) -> list[str]:
    common = ["-target", "wasm32-freestanding"]
    sdk = POLICIES_DIR / "sdk"
    if policy.language == "zig":
        exports = [f"--export={e}" for e in zig_exports(policy.source_dir / "main.zig")]
        return [
            *_zig(), "build-exe", *common, "-O", "ReleaseFast", "-fno-entry", "-fstrip",
            "--stack", str(STACK_BYTES), *exports,
            "--dep", "epick", f"-Mroot={policy.source_dir / 'main.zig'}", f"-Mepick={sdk / 'epick.zig'}",
            f"-femit-bin={out}",
        ]
    sources = sorted(str(p) for p in policy.source_dir.glob("*.c"))
    return [
        *_zig(), "cc", *common, "-O2", "-nostdlib", "-fno-builtin", "-ffreestanding", "-I", str(sdk),
        "-Wall", "-Werror", "-Wl,--no-entry", "-Wl,--strip-all", f"-Wl,-z,stack-size={STACK_BYTES}",
        "-o", str(out), *sources,
    ]


def default_cache() -> Path:
    """Zig's caches: outside the tree, shared between builds (they never change outputs)."""
    return Path(tempfile.gettempdir()) / "epick-zig-cache"


def build(policy: Policy, out_dir: Path, cache: Path | None = None) -> Path:
    """Build one policy into ``out_dir/NAME.wasm``; raise :class:`BuildError` on failure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{policy.name}.wasm"
    cmd = _command(policy, out)
    cache = cache or default_cache()
    # `zig cc` takes no --cache-dir flags: both front ends read these variables.
    env = {**os.environ, "ZIG_LOCAL_CACHE_DIR": str(cache / "local"), "ZIG_GLOBAL_CACHE_DIR": str(cache / "global")}
    # cwd = the out dir: `zig cc` may drop by-products next to its working directory.
    proc = subprocess.run(cmd, cwd=out_dir, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise BuildError(policy.name, f"zig exited with {proc.returncode}:\n{proc.stderr.strip()}")
    for junk in out_dir.glob(f"{policy.name}.wasm.o"):
        junk.unlink()
    return out


def check_zig() -> None:
    """Refuse to build with a Zig other than :data:`ZIG_VERSION` (outputs would differ)."""
    proc = subprocess.run([*_zig(), "version"], capture_output=True, text=True)
    found = proc.stdout.strip() or proc.stderr.strip()
    if proc.returncode != 0 or found != ZIG_VERSION:
        raise BuildError(None, f"the policies build with Zig {ZIG_VERSION} (pip install ziglang=={ZIG_VERSION}), found {found!r}")


def build_all(out_dir: Path, names: list[str] | None = None, cache: Path | None = None) -> list[Path]:
    """Build every policy (or the named ones) into ``out_dir``, two at a time."""
    check_zig()
    policies = discover()
    if names:
        known = {p.name for p in policies}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise BuildError(unknown[0], f"no such policy under {POLICIES_DIR} (known: {', '.join(sorted(known))})")
        policies = [p for p in policies if p.name in names]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda p: build(p, out_dir, cache), policies))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epick.policies_build", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="policies to build (default: all)")
    ap.add_argument("--out", type=Path, default=BUILTIN_DIR, help="output directory (default: host/builtin)")
    ap.add_argument("--check", action="store_true",
                    help="build into a temp dir and fail if any committed host/builtin/*.wasm differs")
    args = ap.parse_args(argv)
    try:
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                stale = []
                for built in build_all(Path(tmp), args.names):
                    committed = args.out / built.name
                    if not committed.is_file() or committed.read_bytes() != built.read_bytes():
                        stale.append(str(committed))
                if stale:
                    print("stale or missing (run `make policies`): " + ", ".join(stale), file=sys.stderr)
                    return 1
                print(f"{args.out} is up to date")
                return 0
        for path in build_all(args.out, args.names):
            print(f"built {path} ({path.stat().st_size} bytes)")
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
