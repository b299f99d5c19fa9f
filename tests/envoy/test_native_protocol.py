"""The whole ext_proc protocol suite (test_ext_proc_protocol.py) again, with the native
front end (``[server] frontend = "native"``: the C++ worker ``epick-extproc``, built by
``make native``) instead of the Python one: the same messages in, the same answers and
completion reports out (the observer streams of envoy-observer.yaml included). A gRPC
client plays Envoy; real Envoy is in test_native_envoy.py and test_native_observer.py.
"""

from __future__ import annotations

import pytest
import test_ext_proc_protocol
from native import collect

collect(test_ext_proc_protocol, globals())


@pytest.fixture
def epick(native_epick):
    return native_epick
