"""Loading vector files: the built-in sets under conformance/vectors/ and a policy author's own.

Every error names the file, and msgspec's path inside it, e.g.
``lora.toml: Expected `float`, got `str` - at `$.case[3].expect.scores[0]```.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import msgspec

from epick.conformance.schema import Case, VectorFile

__all__ = ["VECTORS_DIR", "VectorError", "LoadedCase", "load_file", "builtin_files", "load"]

#: The built-in vector sets (one or more files per policy kind): package data of
#: ``epick.conformance``, so an installed wheel has them too. (Through the package, not
#: ``epick.conformance.vectors``: that name is this module, the folder beside it.)
VECTORS_DIR = Path(str(resources.files("epick.conformance") / "vectors"))


class VectorError(ValueError):
    """A vector file is missing, is not valid TOML, or does not match the schema."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class LoadedCase:
    """A case with the file it came from and its effective params (file's, then case's)."""

    case: Case
    params: dict
    source: Path

    @property
    def name(self) -> str:
        return self.case.name


def load_file(path: Path | str) -> VectorFile:
    """Read and validate one vector file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise VectorError(path, f"cannot read vector file: {exc.strerror or exc}") from exc
    try:
        return msgspec.toml.decode(data, type=VectorFile)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise VectorError(path, str(exc)) from exc


def builtin_files(kind: str) -> list[Path]:
    """The built-in vector files whose ``kind`` is ``kind`` (sorted by name)."""
    return [p for p in sorted(VECTORS_DIR.glob("*.toml")) if load_file(p).kind == kind]


def load(kind: str, extra: Iterable[Path | str] = (), *, builtin: bool = True
         ) -> list[LoadedCase]:
    """The cases for a policy of ``kind``: the built-in ones (unless ``builtin=False``),
    then each extra file's.

    An extra file written for another kind is refused (a ``load`` vector run against a
    LoRA policy can only fail confusingly); ``custom`` files run against any policy, and
    so do ``host`` files (they check the host stage, not the module).
    Case names must be unique across everything loaded.
    """
    files = [(p, load_file(p)) for p in builtin_files(kind)] if builtin else []
    for p in extra:
        vf = load_file(p)
        if vf.kind not in (kind, "custom", "host"):
            raise VectorError(
                p, f"its kind {vf.kind!r} does not match the policy's kind {kind!r}"
            )
        files.append((Path(p), vf))
    out: list[LoadedCase] = []
    seen: dict[str, Path] = {}
    for path, vf in files:
        for case in vf.cases:
            if case.name in seen:
                raise VectorError(
                    path, f"case name {case.name!r} is already used in {seen[case.name]}"
                )
            seen[case.name] = path
            out.append(LoadedCase(case=case, params={**vf.params, **case.params}, source=path))
    return out
