"""The whole ext_proc protocol suite (test_ext_proc_protocol.py) again, with the native
front end (``[server] frontend = "native"``: the C++ worker ``epick-extproc``, built by
``make native``) instead of the Python one: the same messages in, the same answers and
completion reports out. A gRPC client plays Envoy; real Envoy is in test_native_envoy.py.

Left out: the observer streams (the native worker has none: it refuses them, below).
"""

from __future__ import annotations

import pytest
import test_ext_proc_protocol as protocol
from native import build_native

# Every protocol test, collected here too (with this module's ``epick`` fixture).
for _name in dir(protocol):
    if _name.startswith("test_") and "observe" not in _name:
        globals()[_name] = getattr(protocol, _name)
from test_ext_proc_protocol import mode, pool  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="session")
def native_binary():
    return build_native()


@pytest.fixture
def epick(epick, native_binary):
    """The conftest's ``epick``, served by one native worker."""
    def start(addresses, *, server=None, **kw):
        return epick(addresses, server={**(server or {}), "frontend": "native"}, **kw)
    return start
