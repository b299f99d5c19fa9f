"""Precise prefix routing from the engines' own KV-cache events (issue 16).

``events`` (vLLM's wire format), ``hashing`` (vLLM's block hashes), ``index`` (which
blocks each endpoint holds), ``tokenize`` (the model's own tokenizer), ``subscriber``
(one ZMQ task per endpoint) and ``routing`` (per-candidate counts for a Pick).
"""
