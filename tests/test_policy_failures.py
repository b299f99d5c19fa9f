"""One error family for policy failures: every class is a PolicyFailure with a kind, and
one table gives each kind its gRPC and HTTP status."""

from __future__ import annotations

import grpc
import pytest

from epick.api.picker import status_for
from epick.api.status import GRPC_CODES, grpc_code
from epick.conformance import ConformanceError
from epick.interfaces import (
    STATUS,
    FailureKind,
    PluginError,
    PluginSpecError,
    PolicyFailure,
    check_plugin,
    status_of,
)
from epick.policy_manager import LoadsBusy, PolicyRejected, check_name, read_module
from epick.runtime import errors as rt
from epick.runtime.plugin import error_kind

C = grpc.StatusCode
EXPECTED = {
    FailureKind.INVALID_MODULE: (C.FAILED_PRECONDITION, 422),
    FailureKind.UNREADABLE: (C.FAILED_PRECONDITION, 422),
    FailureKind.NONCONFORMANT: (C.FAILED_PRECONDITION, 422),
    FailureKind.UNCHECKABLE: (C.FAILED_PRECONDITION, 422),
    FailureKind.SPEC: (C.FAILED_PRECONDITION, 422),
    FailureKind.BAD_ARGUMENT: (C.INVALID_ARGUMENT, 400),
    FailureKind.BUSY: (C.RESOURCE_EXHAUSTED, 429),
    FailureKind.CONFLICT: (C.ABORTED, 409),
    FailureKind.ERROR: (C.FAILED_PRECONDITION, 422),
    FailureKind.TRAP: (C.FAILED_PRECONDITION, 422),
    FailureKind.TIMEOUT: (C.FAILED_PRECONDITION, 422),
    FailureKind.OUT_OF_FUEL: (C.FAILED_PRECONDITION, 422),
    FailureKind.INVALID_OUTPUT: (C.FAILED_PRECONDITION, 422),
    FailureKind.CIRCUIT_OPEN: (C.UNAVAILABLE, 503),
    FailureKind.RECOVERING: (C.UNAVAILABLE, 503),
    FailureKind.FAILED_LIVE: (C.FAILED_PRECONDITION, 422),
}


def test_the_table_gives_every_kind_a_status():
    assert set(STATUS) == set(FailureKind) == set(GRPC_CODES)


@pytest.mark.parametrize("kind", list(FailureKind), ids=lambda k: k.value)
def test_each_kind_maps_to_its_status(kind):
    code, http = EXPECTED[kind]
    assert grpc_code(kind) == code and status_of(kind).http == http
    failure = PolicyFailure("x", kind=kind)
    assert grpc_code(failure) == code and status_of(failure).http == http
    assert status_for(failure) == code  # the pick path's mapping reads the same table


def test_the_kinds_keep_their_metric_label_spelling():
    # epick_policy_errors_total{kind} and Explanation.skipped_policies carry these.
    assert [str(k) for k in (FailureKind.ERROR, FailureKind.TRAP, FailureKind.TIMEOUT,
                             FailureKind.OUT_OF_FUEL, FailureKind.INVALID_OUTPUT,
                             FailureKind.CIRCUIT_OPEN, FailureKind.RECOVERING,
                             FailureKind.FAILED_LIVE)] == [
        "error", "trap", "timeout", "out-of-fuel", "invalid-output", "circuit-open",
        "recovering", "failed-live"]
    e = PluginError("p", "score", "out-of-fuel", "ran out")
    assert e.kind is FailureKind.OUT_OF_FUEL and str(e) == "policy 'p' score: out-of-fuel: ran out"
    with pytest.raises(ValueError, match="'oops' is not a valid FailureKind"):
        PluginError("p", "score", "oops", "?")


@pytest.mark.parametrize("exc, kind", [
    (rt.PolicyError("p", None, "x"), FailureKind.ERROR),
    (rt.PolicyLoadError("p", "init", "refused"), FailureKind.INVALID_MODULE),
    (rt.PolicyCallError("p", "score", 2, "no"), FailureKind.ERROR),
    (rt.PolicyTrap("p", "score", "UNREACHABLE", "trap"), FailureKind.TRAP),
    (rt.PolicyTimeout("p", "score", 50.0), FailureKind.TIMEOUT),
    (rt.PolicyOutOfFuel("p", "score", 10), FailureKind.OUT_OF_FUEL),
    (rt.PolicyOutputError("p", "score", "NaN"), FailureKind.INVALID_OUTPUT),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_the_runtime_errors_are_policy_failures_with_their_kind(exc, kind):
    assert isinstance(exc, PolicyFailure) and exc.kind is kind and exc.policy == "p"
    assert error_kind(exc) == exc.kind  # the plugin's metric label agrees with the class


def test_the_five_families_are_one():
    class Bare:
        pass

    with pytest.raises(PolicyFailure) as spec:
        check_plugin("bare", Bare())
    assert isinstance(spec.value, PluginSpecError) and isinstance(spec.value, TypeError)
    assert spec.value.kind is FailureKind.SPEC and spec.value.policy == "bare"
    assert ConformanceError("bad vectors").kind is FailureKind.UNCHECKABLE
    assert isinstance(ConformanceError("x"), ValueError)
    assert LoadsBusy("p", "queue full").kind is FailureKind.BUSY
    assert isinstance(LoadsBusy("p", "x"), PolicyRejected)
    assert PolicyRejected("p", "why").kind is FailureKind.INVALID_MODULE
    plugin = PluginError("p", "filter", FailureKind.TRAP, "t")
    assert isinstance(plugin, PolicyFailure) and plugin.policy == plugin.plugin == "p"


def test_the_managers_refusals_carry_their_kind(tmp_path):
    with pytest.raises(PolicyRejected) as bad_name:
        check_name("../x")
    assert bad_name.value.kind is FailureKind.BAD_ARGUMENT
    with pytest.raises(PolicyRejected) as missing:
        read_module(tmp_path / "nope.wasm")
    assert missing.value.kind is FailureKind.UNREADABLE
    assert grpc_code(missing.value) == C.FAILED_PRECONDITION
