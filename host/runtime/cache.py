"""Compiled-artifact cache: ``Module.serialize`` output on disk, keyed by content hash.

File name: ``<sha256 of the wasm>-<engine fingerprint>.cwasm``. The fingerprint covers
the wasmtime version and every Config setting the runtime makes, because an artifact is
only loadable by an identical engine. Writes are atomic (temp file + rename), so
concurrent compilers at worst both compile. An unreadable or stale artifact is
recompiled and overwritten.

Trust: ``Module.deserialize`` runs the machine code in the file as is. The cache
directory must be writable only by the service (it is the same trust level as the
service's own code).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import wasmtime

__all__ = ["ArtifactCache"]

log = logging.getLogger(__name__)


class ArtifactCache:
    """Loads and stores compiled modules for one engine configuration."""

    def __init__(self, directory: Path, fingerprint: str) -> None:
        self.directory = Path(directory)
        self.fingerprint = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.directory / f"{sha256}-{self.fingerprint}.cwasm"

    def load(self, engine: wasmtime.Engine, sha256: str) -> wasmtime.Module | None:
        """The cached module for ``sha256``, or ``None`` (missing or unusable)."""
        path = self.path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("artifact cache: cannot read %s: %s", path, exc)
            return None
        try:
            return wasmtime.Module.deserialize(engine, data)
        except wasmtime.WasmtimeError as exc:
            log.warning("artifact cache: %s is unusable, recompiling: %s", path, exc)
            return None

    def store(self, sha256: str, module: wasmtime.Module) -> None:
        """Write ``module``'s artifact; failures are logged, never raised (it is a cache)."""
        path = self.path(sha256)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".cwasm")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(module.serialize())
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            log.warning("artifact cache: cannot write %s: %s", path, exc)
