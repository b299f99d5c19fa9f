"""ArtifactCache: compiled modules on disk, keyed by the wasm's content hash and the
engine's settings; anything unusable is a miss, never an error."""

from __future__ import annotations

import hashlib
import logging

import wasmtime
from wat_modules import wasm

from epick.runtime import Limits, Runtime
from epick.runtime.cache import ArtifactCache

WAT = "(module (func (export \"f\") (result i32) (i32.const 7)))"


def compiled(engine: wasmtime.Engine) -> tuple[str, wasmtime.Module]:
    data = wasmtime.wat2wasm(WAT)
    return hashlib.sha256(data).hexdigest(), wasmtime.Module(engine, data)


def test_a_stored_module_loads_back_and_runs(tmp_path):
    engine = wasmtime.Engine()
    cache = ArtifactCache(tmp_path / "c", "settings A")
    sha, module = compiled(engine)
    assert cache.load(engine, sha) is None
    cache.store(sha, module)
    loaded = cache.load(engine, sha)
    store = wasmtime.Store(engine)
    assert wasmtime.Instance(store, loaded, []).exports(store)["f"](store) == 7
    assert [p.name for p in (tmp_path / "c").iterdir()] == [cache.path(sha).name]  # no temp


def test_the_file_name_is_the_content_hash_and_the_engine_fingerprint(tmp_path):
    a, b = ArtifactCache(tmp_path, "settings A"), ArtifactCache(tmp_path, "settings B")
    assert a.path("ab" * 32).name.startswith("ab" * 32 + "-")
    assert a.path("ab" * 32) != b.path("ab" * 32)  # another engine: another artifact
    assert a.path("ab" * 32) != a.path("cd" * 32)


def test_an_unusable_artifact_is_a_miss_with_a_warning(tmp_path, caplog):
    engine = wasmtime.Engine()
    cache = ArtifactCache(tmp_path, "settings")
    sha, _ = compiled(engine)
    cache.path(sha).write_bytes(b"not machine code")
    with caplog.at_level(logging.WARNING):
        assert cache.load(engine, sha) is None
    assert "is unusable, recompiling" in caplog.text


def test_a_store_that_cannot_write_logs_and_does_not_raise(tmp_path, caplog):
    engine = wasmtime.Engine()
    cache = ArtifactCache(tmp_path / "gone", "settings")
    sha, module = compiled(engine)
    (tmp_path / "gone").rmdir()
    with caplog.at_level(logging.WARNING):
        cache.store(sha, module)
    assert "artifact cache: cannot write" in caplog.text


def test_the_runtime_finds_a_kept_module_by_its_bytes_after_a_restart(tmp_path):
    one, other = wasm("counter"), wasm("flaky")
    with Runtime(Limits(), cache_dir=tmp_path) as rt:
        rt.keep(rt.compile(one, name="counter"))
        assert not rt.compile(other, name="flaky")._cached  # compiled, never kept
    files = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert files == [hashlib.sha256(one).hexdigest()]
    with Runtime(Limits(), cache_dir=tmp_path) as rt:
        assert rt.compile(one, name="renamed")._cached  # same bytes, any name: a hit
        assert not rt.compile(other, name="flaky")._cached
