"""A stand-in for ``epick.runtime`` with the same surface, on wasmtime's plain API.

Used only until ``epick.runtime`` lands (see conftest.py): slow (``Func.__call__``), no
limits, but the same calls — so the tests do not change when the real runtime replaces it.
"""

from __future__ import annotations

import msgspec
import numpy as np
import wasmtime

from epick import abi


class PolicyCallError(Exception):
    def __init__(self, name: str, export: str, message: str) -> None:
        super().__init__(f"policy {name!r} {export}: {message}")
        self.message = message


class Runtime:
    def __init__(self, limits: object = None) -> None:
        self.engine = wasmtime.Engine()

    def close(self) -> None:
        pass

    def compile(self, wasm: bytes, name: str) -> "PolicyModule":
        return PolicyModule(self, wasmtime.Module(self.engine, wasm), name)


class PolicyModule:
    def __init__(self, rt: Runtime, module: wasmtime.Module, name: str) -> None:
        self.rt, self.module, self.name = rt, module, name

    def instantiate(self, params: dict | None = None) -> "PolicyInstance":
        return PolicyInstance(self, params or {})


class PolicyInstance:
    def __init__(self, mod: PolicyModule, params: dict) -> None:
        self.name = mod.name
        self.store = wasmtime.Store(mod.rt.engine)
        inst = wasmtime.Instance(self.store, mod.module, [])
        self.ex = inst.exports(self.store)
        self.mem: wasmtime.Memory = self.ex["memory"]
        assert self.ex["epick_abi_version"](self.store) == 1
        self.buf, self.cap = 0, 0
        self.out = self.ex["alloc"](self.store, 64 * 1024)
        self.init(params)

    def _put(self, data: bytes) -> int:
        if len(data) > self.cap:
            self.cap = max(len(data), 2 * self.cap, 4096)
            self.buf = self.ex["alloc"](self.store, self.cap)
            assert self.buf != 0
        self.mem.write(self.store, data, self.buf)
        return self.buf

    def _check(self, export: str, rc: int) -> None:
        if rc != 0:
            p, n = self.ex["error_ptr"](self.store), self.ex["error_len"](self.store)
            raise PolicyCallError(self.name, export, self.mem.read(self.store, p, p + n).decode())

    def _call(self, export: str, data: bytes, *extra: int) -> None:
        ptr = self._put(data)
        self._check(export, self.ex[export](self.store, ptr, len(data), *extra))

    def init(self, params: dict) -> None:
        self._call("init", msgspec.msgpack.encode(params))

    def set_snapshot(self, data: bytes) -> None:
        self._call("set_snapshot", data)

    def score(self, data: bytes, n: int) -> np.ndarray:
        self._call("score", data, self.out)
        return np.frombuffer(self.mem.read(self.store, self.out, self.out + 8 * n), dtype="<f8").copy()

    def filter(self, data: bytes, n: int) -> np.ndarray:
        self._call("filter", data, self.out)
        return np.frombuffer(self.mem.read(self.store, self.out, self.out + n), dtype=np.uint8).astype(bool)

    def pre_request(self, data: bytes) -> None:
        self._call("pre_request", data)

    def post_response(self, data: bytes) -> None:
        self._call("post_response", data)

    def _output(self) -> bytes:
        p, n = self.ex["output_ptr"](self.store), self.ex["output_len"](self.store)
        return self.mem.read(self.store, p, p + n)

    def describe(self) -> abi.Describe:
        self._check("describe", self.ex["describe"](self.store))
        return msgspec.msgpack.decode(self._output(), type=abi.Describe)

    def export_state(self) -> bytes:
        self._check("export_state", self.ex["export_state"](self.store))
        return self._output()

    def import_state(self, data: bytes) -> None:
        self._call("import_state", data)

    def memory_bytes(self) -> int:
        return self.mem.data_len(self.store)
