"""The whole ext_proc protocol suite (test_ext_proc_protocol.py) again, with the native
front end (``[server] frontend = "native"``: the C++ worker ``epick-extproc``, built by
``make native``) instead of the Python one: the same messages in, the same answers and
completion reports out. A gRPC client plays Envoy; real Envoy is in test_native_envoy.py.

Left out: the observer streams (the native worker has none; test_native_envoy.py checks
that it refuses them).
"""

from __future__ import annotations

import pytest
import test_ext_proc_protocol
from native import collect

collect(test_ext_proc_protocol, globals(), skip=("observe",))


@pytest.fixture
def epick(native_epick):
    return native_epick
