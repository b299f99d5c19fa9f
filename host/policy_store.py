"""Policies loaded through the admin API, kept on disk so a restart does not lose them.

Switched on by ``[admin] persist_dir``. One policy is two files in that folder::

    NAME.wasm   the module exactly as LoadPolicy received it
    NAME.json   params, weight, shadow (a small versioned JSON object)

LoadPolicy writes both (each atomically: a temp file, then a rename), SetWeight rewrites
the table, RemovePolicy deletes both. The admin API runs each of these on a worker thread
(:meth:`PolicyStore.off_loop`: one at a time, in the order asked), so writing a module of
up to the size cap never stalls picks on the event loop. At start the service loads every saved policy after
the config's (a saved policy whose name the config also uses replaces it, as the admin
load did). A saved policy that no longer loads is logged and left on disk, untouched.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

__all__ = ["PolicyStore", "SavedPolicy", "StoreError"]

log = logging.getLogger("epick.policies")

STORE_VERSION = 1


class StoreError(Exception):
    """A saved policy cannot be read or written; ``str()`` names the file."""


class SavedPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    version: int = STORE_VERSION
    params: dict[str, Any] = {}
    weight: float | None = None
    shadow: bool = False


def write_file(f, data: bytes) -> None:
    """How a file's bytes are written (the ``write`` seam of :class:`PolicyStore`)."""
    f.write(data)


class PolicyStore:
    """The ``persist_dir`` folder. Its methods block (file I/O): the service calls them
    through :meth:`off_loop`, never on the event loop itself.

    ``write(f, data)`` writes ``data`` to the open temp file ``f`` (a seam: tests pass a
    slow writer to hold a save in progress)."""

    def __init__(self, folder: Path, *, write: Callable[[Any, bytes], None] = write_file
                 ) -> None:
        self.folder = folder
        self.write = write
        self._limiter: anyio.CapacityLimiter | None = None  # made on the event loop

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a method of this store) on a worker thread. One runs at a time,
        in the order asked (the limiter is FIFO), so the folder ends as the last change
        left it; a cancelled caller still waits for the write it started to finish."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args),
                                              limiter=self._limiter)

    def _paths(self, name: str) -> tuple[Path, Path]:
        return self.folder / f"{name}.wasm", self.folder / f"{name}.json"

    def _write(self, path: Path, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                self.write(f, data)
            os.replace(tmp, path)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise StoreError(f"{path}: cannot save: {exc.strerror or exc}") from exc
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def save(self, name: str, wasm: bytes, saved: SavedPolicy) -> None:
        wasm_path, meta_path = self._paths(name)
        self._write(wasm_path, wasm)
        self._write(meta_path, msgspec.json.encode(_without_none(saved)))

    def set_weight(self, name: str, weight: float) -> bool:
        """Record a new weight for a saved policy; False if ``name`` is not saved here."""
        wasm_path, meta_path = self._paths(name)
        if not wasm_path.is_file():
            return False
        saved = msgspec.structs.replace(self._read_meta(name), weight=weight)
        self._write(meta_path, msgspec.json.encode(_without_none(saved)))
        return True

    def remove(self, name: str) -> None:
        for path in self._paths(name):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise StoreError(f"{path}: cannot delete: {exc.strerror or exc}") from exc

    def _read_meta(self, name: str) -> SavedPolicy:
        _, meta_path = self._paths(name)
        try:
            return msgspec.json.decode(meta_path.read_bytes(), type=SavedPolicy)
        except FileNotFoundError:
            return SavedPolicy()
        except OSError as exc:
            raise StoreError(f"{meta_path}: cannot read: {exc.strerror or exc}") from exc
        except msgspec.DecodeError as exc:
            raise StoreError(f"{meta_path}: {exc}") from exc

    def load_all(self) -> list[tuple[str, bytes, SavedPolicy]]:
        """Every saved policy, by name; unreadable ones are logged and skipped."""
        if not self.folder.is_dir():
            return []
        out = []
        for wasm_path in sorted(self.folder.glob("*.wasm")):
            name = wasm_path.stem
            try:
                wasm = wasm_path.read_bytes()
                out.append((name, wasm, self._read_meta(name)))
            except (OSError, StoreError) as exc:
                log.error("saved policy %r not loaded (left on disk): %s", name, exc)
        return out


def _without_none(saved: SavedPolicy) -> dict:
    # An unset weight is absent rather than null: the file reads as it was asked for.
    return {k: v for k, v in msgspec.structs.asdict(saved).items() if v is not None}
