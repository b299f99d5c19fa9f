"""The ``epick.v1.Admin`` gRPC service: load, remove, reweigh and list policies live.

Served on its own port. Every call must carry ``authorization: Bearer TOKEN``; with no
token configured every call is refused (an admin API open to anyone who can reach the
port would let them run code in the picker).
"""

from __future__ import annotations

import hmac
import json

import grpc

from epick.api.gen.epick.v1 import admin_pb2, admin_pb2_grpc
from epick.api.status import grpc_code
from epick.policy_manager import MAX_MODULE_BYTES, PolicyManager, PolicyRejected, check_name
from epick.policy_store import PolicyStore, SavedPolicy, StoreError
from epick.scheduler.policyset import UnknownPolicyError

__all__ = ["AdminService", "MAX_MODULE_BYTES", "MAX_REQUEST_BYTES"]

#: The admin server's largest message: a module at the cap plus its name and params.
#: gRPC refuses a bigger one (RESOURCE_EXHAUSTED) from its length prefix, before reading
#: it: a 30 MiB upload costs the picks nothing.
MAX_REQUEST_BYTES = MAX_MODULE_BYTES + (256 << 10)


def _describe_scheme(scheme: str, rest: str) -> str:
    """What was sent instead of ``Bearer TOKEN``, without repeating a possible secret."""
    if not rest:
        return "got a bare value with no scheme: prefix the token with 'Bearer '"
    if scheme.lower() in ("basic", "digest", "token", "apikey", "key"):
        return f"got the {scheme.capitalize()} scheme: send 'Bearer TOKEN' instead"
    return "got a value that does not start with 'Bearer ': prefix the token with 'Bearer '"


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, manager: PolicyManager, token: str, *,
                 store: PolicyStore | None = None) -> None:
        self.manager = manager
        self._token = token
        self.store = store
        """``[admin] persist_dir``: admin changes are saved there for restarts."""

    async def _authorize(self, context) -> None:
        if not self._token:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "admin API has no token configured; set [admin] token or EPICK_ADMIN_TOKEN",
            )
        header = dict(context.invocation_metadata()).get("authorization", "")
        if not header:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing 'authorization: Bearer TOKEN' metadata",
            )
        scheme, _, given = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            # Say what the header looks like, never echo it: it may be the token itself.
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the authorization metadata must be 'Bearer TOKEN'; "
                f"{_describe_scheme(scheme, given)}",
            )
        if not given.strip():
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "'authorization: Bearer' carries no token after 'Bearer '")
        if not hmac.compare_digest(given.strip().encode(), self._token.encode()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "wrong admin token")

    def _info(self, name: str) -> admin_pb2.PolicyInfo:
        entry, active = self.manager.get(name)
        plugin = entry.plugin
        stats = getattr(plugin, "stats", None)
        breaker = getattr(plugin, "breaker_state", "closed")
        return admin_pb2.PolicyInfo(
            name=name,
            version=active.version,
            sha256=active.module.sha256,
            weight=entry.weight,
            shadow=entry.shadow,
            calls=getattr(stats, "calls", 0),
            errors=getattr(stats, "errors", 0),
            p50_us=getattr(stats, "p50_us", 0.0),
            p99_us=getattr(stats, "p99_us", 0.0),
            kind=active.kind,
            breaker=breaker() if callable(breaker) else str(breaker),
            shadow_agreement=self.manager.scheduler.shadow_agreement(plugin),
            origin=active.origin,
            recoveries=getattr(stats, "recoveries", 0),
            timeout_retries=getattr(stats, "timeout_retries", 0),
            breaker_opens=getattr(plugin, "breaker_opens", 0),
            breakers=" ".join(f"{k}={v}" for k, v in
                              getattr(plugin, "breaker_states", {}).items()),
            smoke_fuel=max(active.smoke_fuel.values(), default=0),
            recovering_skips=getattr(stats, "errors_by_kind", {}).get("recovering", 0),
        )

    async def LoadPolicy(self, request, context):
        await self._authorize(context)
        if not request.name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadPolicy.name is required")
        try:
            check_name(request.name)
        except PolicyRejected as exc:
            await context.abort(grpc_code(exc), f"LoadPolicy.name: {exc.reason}")
        if not request.wasm:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadPolicy.wasm is empty")
        try:
            params = json.loads(request.params_json) if request.params_json else {}
        except json.JSONDecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"LoadPolicy.params_json is not JSON: {exc.msg} at line {exc.lineno} "
                f"column {exc.colno}",
            )
        if not isinstance(params, dict):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"LoadPolicy.params_json must be a JSON object, got {type(params).__name__}",
            )
        weight = request.weight if request.HasField("weight") else None
        try:
            await self.manager.activate_async(
                request.name, request.wasm, params, weight=weight,
                shadow=request.shadow, source="admin",
            )
        except PolicyRejected as exc:  # the status by its kind (epick.interfaces.STATUS)
            await context.abort(grpc_code(exc), str(exc))
        if self.store is not None:
            await self._saved(context, request.name, self.store.save, request.name,
                              request.wasm, SavedPolicy(params=params, weight=weight,
                                                        shadow=request.shadow))
        return self._info(request.name)

    async def _saved(self, context, name: str, change, *args) -> None:
        """``change(*args)`` on the store, on its worker thread (a module of up to the cap
        is written: never on the loop)."""
        try:
            await self.store.off_loop(change, *args)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"policy {name!r} is live, but not saved for a restart: {exc}")

    async def RemovePolicy(self, request, context):
        await self._authorize(context)
        try:
            self.manager.remove(request.name)
        except UnknownPolicyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        if self.store is not None:
            await self._saved(context, request.name, self.store.remove, request.name)
        return admin_pb2.RemovePolicyResponse()

    async def SetWeight(self, request, context):
        await self._authorize(context)
        try:
            self.manager.set_weight(request.name, request.weight)
        except UnknownPolicyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except PolicyRejected as exc:
            await context.abort(grpc_code(exc), str(exc))
        if self.store is not None:
            await self._saved(context, request.name, self.store.set_weight, request.name,
                              request.weight)
        return self._info(request.name)

    async def ListPolicies(self, request, context):
        await self._authorize(context)
        return admin_pb2.ListPoliciesResponse(
            policies=[self._info(name) for name in self.manager.names()]
        )
