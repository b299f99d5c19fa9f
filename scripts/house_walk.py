"""Which hand-written files one Pick and one admin hot swap run through, which files call
into which, and which pairs call each other back (for docs/design.md's "the house").

    .venv/bin/python scripts/house_walk.py [--checkout DIR]

It starts a real service (tests/epick_service.py) on two fake vLLM pages, then records, with
a profile hook on every thread, the repo files whose Python functions run while one unary
Pick is answered (the server side only: the client's stub and the generated protobuf
modules are left out) and while one LoadPolicy of a built-in module is vetted and goes live.
Scraping runs in the pool's worker process, so it is not traced: the pool's interval is
long enough that no scrape round falls inside a window.

``--checkout DIR`` measures another checkout of this repo (e.g. a ``git worktree`` of an
older commit) with this interpreter: its package is assembled under a temporary folder from
the folders its pyproject maps, so no install is needed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def _use_checkout(root: Path, tmp: Path) -> None:
    """Put ``root``'s epick first on sys.path (a folder of symlinks, as pyproject maps it)."""
    mapped = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    pkg = tmp / "epick"
    pkg.mkdir(parents=True)
    for entry in (root / mapped["epick"]).iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in mapped.items():
        if name != "epick":
            link = pkg / name.split(".", 1)[1]
            if not link.exists():
                link.symlink_to(root / folder)
    sys.path[:0] = [str(tmp), str(root / "tests")]
    # An editable install's finder sits on sys.meta_path, ahead of sys.path: drop it.
    sys.meta_path[:] = [f for f in sys.meta_path if "Editable" not in type(f).__name__]


class Recorder:
    """Repo files whose functions run while ``on``, the calls from one repo file into
    another (caller file -> callee file), and the back-and-forths: pairs of files that
    call each other (A -> B and B -> A)."""

    def __init__(self, roots: list[Path], skip: tuple[str, ...]) -> None:
        self.roots = tuple(str(r) for r in roots)
        self.skip = skip
        self.on = False
        self.files: set[str] = set()
        self.edges: set[tuple[str, str]] = set()

    def _ours(self, path: str) -> bool:
        return path.startswith(self.roots) and not any(s in path for s in self.skip)

    def profile(self, frame, event, arg):  # noqa: ARG002 (the hook's signature)
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if not self._ours(path):
            return
        self.files.add(path)
        caller = frame.f_back
        while caller is not None and not self._ours(caller.f_code.co_filename):
            caller = caller.f_back  # through library frames (grpc, asyncio) to our caller
        if caller is not None and caller.f_code.co_filename != path:
            self.edges.add((caller.f_code.co_filename, path))

    def window(self, fn) -> tuple[list[str], set, list[tuple[str, str]]]:
        self.files, self.edges = set(), set()
        self.on = True
        try:
            fn()
        finally:
            self.on = False
        back = sorted((a, b) for a, b in self.edges if (b, a) in self.edges and a < b)
        return sorted(self.files), set(self.edges), back


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, default=HERE,
                    help="the repo checkout to measure (default: this one)")
    args = ap.parse_args(argv)
    root = args.checkout.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if root != HERE:
            _use_checkout(root, tmp / "view")
        else:
            sys.path.insert(0, str(root / "tests"))
        from epick_service import TOKEN, make_config, running
        from fakes import FakeVLLM, vllm_page

        from epick import config as cfg
        from epick.api.gen.epick.v1 import admin_pb2, picker_pb2

        (tmp / "view").mkdir(exist_ok=True)
        builtin = Path(cfg.BUILTIN_POLICY_DIR)
        rec = Recorder([root / "host", root / "conformance", tmp / "view"],
                       skip=("/gen/", "_pb2"))
        servers = [FakeVLLM(vllm_page(model="m")) for _ in range(2)]
        try:
            config = make_config([s.address for s in servers], tmp=tmp,
                                 scrape_interval_ms=60_000, stale_after_ms=600_000)
            threading.setprofile(rec.profile)
            sys.setprofile(rec.profile)
            with running(config) as svc:
                deadline = time.monotonic() + 30
                while True:  # wait for the first scrape round to be published
                    try:
                        svc.picker.Pick(picker_pb2.PickRequest(model="m"), timeout=5)
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
                svc.picker.Pick(picker_pb2.PickRequest(model="m", prompt="warm"), timeout=5)
                req = picker_pb2.PickRequest(model="m", prompt="Hello, house.")
                pick_files, pick_edges, pick_back = rec.window(lambda: svc.picker.Pick(req, timeout=5))
                module = (builtin / "load.wasm").read_bytes()
                load = admin_pb2.LoadPolicyRequest(name="load", wasm=module, weight=1.0)
                swap_files, swap_edges, swap_back = rec.window(lambda: svc.admin.LoadPolicy(
                    load, metadata=[("authorization", f"Bearer {TOKEN}")], timeout=120))
            sys.setprofile(None)
            threading.setprofile(None)
        finally:
            for s in servers:
                s.stop()

    def rel(p: str) -> str:
        """``epick/...``: the same name for a file of this checkout and of a view."""
        path = Path(p)
        if "view" in path.parts:
            return "/".join(path.parts[path.parts.index("view") + 1:])
        path = path.resolve().relative_to(root)
        parts = ("epick",) + path.parts[1:] if path.parts[0] == "host" else (
            "epick",) + path.parts
        return "/".join(parts)

    for title, files, edges, back in (
            ("one Pick", pick_files, pick_edges, pick_back),
            ("one LoadPolicy hot swap", swap_files, swap_edges, swap_back)):
        print(f"{title}: {len(files)} files, {len(edges)} file-to-file calls, "
              f"{len(back)} back-and-forths")
        for f in files:
            print(f"  {rel(f)}")
        for a, b in back:
            print(f"  back-and-forth: {rel(a)} <-> {rel(b)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
