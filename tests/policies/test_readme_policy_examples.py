"""The README's "changed module" example, run as written: copy policies/load to
load-sq, make exactly the edit the README shows, build it with the README's command, and
replay a recorded decision log through it. The copy lives in a temporary policies/ folder
(the build's POLICIES_DIR points there), so the checkout is never touched."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
from policy_payloads import ep, score_input, snap

from epick import policies_build
from epick.cli import main as epick_main

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> list[str]:
    """The lines of the README's code block that follows "A changed module"."""
    text = (ROOT / "README.md").read_text()
    at = text.index("A changed module:")
    block = re.search(r"```\n(.*?)```", text[at:], re.S)
    assert block, "README.md: the changed-module example block is gone"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_example_is_the_copy_the_edit_the_build_and_the_replay():
    lines = readme_example()
    assert lines[0] == "cp -r policies/load policies/load-sq"
    assert lines[1].startswith("# in policies/load-sq/main.zig")
    assert lines[2].startswith("#   o.* = ")
    assert lines[3].startswith(".venv/bin/python -m epick.policies_build --out ")
    assert lines[4].startswith(".venv/bin/epick replay ")


def apply_readme_edit(main_zig: Path, edit: str) -> None:
    """The README's edit: the line that sets ``o.*`` becomes the README's line."""
    source = main_zig.read_text().splitlines(keepends=True)
    targets = [i for i, line in enumerate(source) if line.lstrip().startswith("o.* = ")]
    assert len(targets) == 1, f"{main_zig}: expected one line setting o.*, found {targets}"
    i = targets[0]
    indent = source[i][: len(source[i]) - len(source[i].lstrip())]
    assert source[i].strip() != edit, "the README's edit changes nothing"
    source[i] = indent + edit + "\n"
    main_zig.write_text("".join(source))


@pytest.fixture
def load_sq(tmp_path, monkeypatch) -> Path:
    """policies/load-sq built as the README says; the path of the module."""
    lines = readme_example()
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "sdk").symlink_to(policies_build.POLICIES_DIR / "sdk")
    shutil.copytree(policies_build.POLICIES_DIR / "load", policies / "load-sq")  # the `cp -r`
    apply_readme_edit(policies / "load-sq" / "main.zig", lines[2].removeprefix("#").strip())
    monkeypatch.setattr(policies_build, "POLICIES_DIR", policies)
    argv = shlex.split(lines[3])[3:]  # after `.venv/bin/python -m epick.policies_build`
    out_at = argv.index("--out") + 1
    argv[out_at] = str(tmp_path / "out")
    assert argv[out_at + 1:] == ["load-sq"]
    assert policies_build.main(argv) == 0
    return tmp_path / "out" / "load-sq.wasm"


def test_the_readme_edit_builds_and_squares_the_queue_score(load_sq, modules, runtime):
    edited = runtime.compile(load_sq.read_bytes(), name="load-sq").instantiate({})
    shipped = modules("load").instantiate({})
    pool = [ep("a", waiting=0), ep("b", waiting=5), ep("c", waiting=10)]
    got = edited.score(score_input(snap(pool)), 3)
    base = shipped.score(score_input(snap(pool)), 3)
    # queue scores 1, 0.5, 0: squared 1, 0.25, 0; kv 1 and work 8 / (8 + running +
    # waiting) as in load; weights 1, 1, 2.
    work = np.array([8 / 8, 8 / 13, 8 / 18])
    np.testing.assert_allclose(got, (np.array([1.0, 0.25, 0.0]) + 1.0 + 2 * work) / 4)
    np.testing.assert_allclose(base, (np.array([1.0, 0.5, 0.0]) + 1.0 + 2 * work) / 4)


def test_the_readme_replay_runs_with_the_edited_module(load_sq, runtime, tmp_path, capsys):
    from epick.bench.quality import DEFAULT_WEIGHTS, EpickRouter, wasm_set
    from epick.decisions import DecisionLog
    from epick.sim import workload as wl
    from epick.sim.config import DEFAULT_CONFIG
    from epick.sim.fleet import Fleet

    log_path = tmp_path / "epick.declog"
    router = EpickRouter(wasm_set(runtime, DEFAULT_WEIGHTS), seed=1)
    log = DecisionLog(log_path).attach(router.scheduler).start()
    try:
        requests = wl.shared_prefix(qps=20, duration_s=1.0, seed=2)
        requests = [msgspec.structs.replace(r, request_id=f"r{i}") for i, r in enumerate(requests)]
        Fleet(4, DEFAULT_CONFIG, seed=1).run(requests, router, scrape_interval_s=0.05)
    finally:
        log.close()
    argv = shlex.split(readme_example()[4])[1:]  # after `.venv/bin/epick`
    argv = [str(log_path) if a.endswith("epick.declog") else a for a in argv]
    argv = [f"load={load_sq}" if a.startswith("load=") else a for a in argv]
    assert argv == ["replay", str(log_path), "--policy", f"load={load_sq}"]
    assert epick_main(argv) == 0
    report = capsys.readouterr().out
    assert "agreement" in report
