"""epick — a decision service for LLM inference gateways.

A gateway asks, over gRPC, which model-server replica should serve a request; epick
answers from a per-cycle snapshot of scraped metrics scored by WebAssembly policies.
"""

__version__ = "0.1.0"
