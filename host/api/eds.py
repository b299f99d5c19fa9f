"""The weights table as xDS EDS: a ``ClusterLoadAssignment`` per (model, adapter,
criticality), for Envoy (REST-JSON EDS, ``POST /v3/discovery:endpoints`` on the HTTP front
end) and other xDS clients that take weighted endpoints without ext_proc (docs/weights.md).

A resource name says which table: ``model=M[,adapter=A][,criticality=C]`` (the agent's
``--vip`` syntax in examples/ebpf), or a bare model name. Each eligible endpoint becomes one
``LbEndpoint`` with ``load_balancing_weight`` = its share × :data:`WEIGHT_SCALE` (at least
1); endpoints at weight 0 are left out (Envoy takes no weight-0 endpoint). A table with no
eligible endpoint is an assignment with no endpoints: Envoy answers 503 "no healthy
upstream" rather than send traffic where it would wait.
"""

from __future__ import annotations

import ipaddress

from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import json_format

from epick import abi
from epick.api.gen.epick.v1 import picker_pb2
from epick.api.picker import InvalidArgument
from epick.api.weights import WeightsTable, _features

__all__ = ["TYPE_URL", "WEIGHT_SCALE", "resource_key", "cluster_load_assignment",
           "discovery_response"]

TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
#: Shares become integer weights out of this (Envoy's weights are uint32 ≥ 1; a locality's
#: sum must stay under 2^32).
WEIGHT_SCALE = 1_000_000
_KEYS = ("model", "adapter", "criticality")


def resource_key(name: str) -> tuple[str, str, abi.Criticality]:
    """``model=M[,adapter=A][,criticality=C]`` (or just ``M``) -> the hub's key."""
    if "=" not in name:
        fields: dict[str, object] = {"model": name}
    else:
        fields = {}
        for part in name.split(","):
            k, sep, v = part.partition("=")
            if not sep or k not in _KEYS or k in fields:
                raise InvalidArgument(
                    f"EDS resource name {name!r}: {part!r} is not one of "
                    "model=, adapter=, criticality= (each at most once)")
            fields[k] = v
    crit = fields.get("criticality")
    if isinstance(crit, str) and crit.isdigit():
        fields["criticality"] = int(crit)
    try:
        msg = json_format.ParseDict(fields, picker_pb2.WeightsRequest())
    except json_format.ParseError as exc:
        raise InvalidArgument(f"EDS resource name {name!r}: {exc}") from None
    return _features(msg)


def _socket_address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass  # a hostname: Envoy resolves it (STRICT_DNS clusters) or rejects it
    return host, int(port)


def cluster_load_assignment(name: str, table: WeightsTable) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    eligible = [e for e in table.endpoints if e.weight > 0]
    if not eligible:
        return cla
    lb = cla.endpoints.add().lb_endpoints
    for e in eligible:
        host, port = _socket_address(e.endpoint)
        ep = lb.add()
        ep.endpoint.address.socket_address.address = host
        ep.endpoint.address.socket_address.port_value = port
        ep.load_balancing_weight.value = max(1, round(e.weight * WEIGHT_SCALE))
    return cla


def discovery_response(tables: dict[str, WeightsTable]) -> discovery_pb2.DiscoveryResponse:
    """One response for every requested name; ``version_info``: the tables' snapshot
    versions."""
    version = "-".join(str(t.snapshot_version) for t in tables.values())
    resp = discovery_pb2.DiscoveryResponse(version_info=version, type_url=TYPE_URL)
    for name, table in tables.items():
        resp.resources.add().Pack(cluster_load_assignment(name, table))
    return resp
