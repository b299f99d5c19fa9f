"""Gateways that put epick in a request path: a reference OpenAI-compatible HTTP proxy
(``epick.gateway.proxy``); run it with ``python -m epick.gateway``."""
