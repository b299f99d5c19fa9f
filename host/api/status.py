"""A policy failure as a gRPC status: :data:`epick.interfaces.STATUS` (the one table of
kind -> status), with its gRPC code names made ``grpc.StatusCode``s. The HTTP front end
reads the same table's ``http`` column."""

from __future__ import annotations

import grpc

from epick.interfaces import STATUS, FailureKind, PolicyFailure

__all__ = ["grpc_code", "GRPC_CODES"]

#: Each kind's gRPC code, from the table (a name that is not a gRPC code fails here, at
#: import, not when the first failure is answered).
GRPC_CODES: dict[FailureKind, grpc.StatusCode] = {
    kind: grpc.StatusCode[status.grpc] for kind, status in STATUS.items()}


def grpc_code(failure: PolicyFailure | FailureKind) -> grpc.StatusCode:
    """The gRPC status code a front end answers ``failure`` with."""
    return GRPC_CODES[failure if isinstance(failure, FailureKind) else failure.kind]
