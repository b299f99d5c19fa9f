"""Building mutated copies of the shipped policies (for tests that the suite catches bugs)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from epick.policies_build import POLICIES_DIR, Policy, build

#: Built mutants, keyed by a hash of every source that goes into them: a rerun with
#: unchanged sources reuses them instead of spending ~10 s of Zig per mutant.
MUTANT_CACHE = Path(tempfile.gettempdir()) / "epick-conformance-mutants"

#: (old text, new text): one text replacement in the policy's main.zig.
Mutation = tuple[str, str]


def mutate(source: str, mutations: Sequence[Mutation], where: str) -> str:
    """Apply text mutations; each anchor must occur exactly once (else the test is stale)."""
    for old, new in mutations:
        n = source.count(old)
        if n != 1:
            raise AssertionError(
                f"mutation anchor {old!r} occurs {n} times in {where}; update the mutant"
            )
        source = source.replace(old, new)
    return source


def _sdk_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((POLICIES_DIR / "sdk").glob("*")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def build_mutant(policy: str, mutations: Sequence[Mutation]) -> Path:
    """Copy policies/POLICY to a temp dir, apply ``mutations``, build it; the .wasm path."""
    src = POLICIES_DIR / policy / "main.zig"
    text = mutate(src.read_text(), mutations, str(src))
    key = hashlib.sha256((text + _sdk_digest()).encode()).hexdigest()[:20]
    cached = MUTANT_CACHE / f"{policy}-{key}.wasm"
    if cached.is_file():
        return cached
    MUTANT_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / policy
        work.mkdir()
        (work / "main.zig").write_text(text)
        out = build(Policy(policy, work, "zig"), Path(tmp) / "out")
        partial = cached.with_suffix(".part")
        shutil.copyfile(out, partial)
        partial.replace(cached)  # atomic: a concurrent run never sees half a file
    return cached


def build_mutants(specs: dict[str, tuple[str, Sequence[Mutation]]]) -> dict[str, Path]:
    """Build several mutants, two at a time (the machine has two cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(build_mutant, p, m) for k, (p, m) in specs.items()}
        return {k: f.result() for k, f in futures.items()}


def assert_fails_on(module, case: str, words: str) -> None:
    """The conformance run of a mutant ``module`` fails, and ``case`` fails saying ``words``."""
    from epick.conformance import check

    report = check(module, {}, properties=False)
    assert not report.passed
    failed = {c.name: c for c in report.failures}
    assert case in failed, f"{case} passed; failures: {sorted(failed)}"
    assert failed[case].verdict == "fail"
    assert words in failed[case].why
