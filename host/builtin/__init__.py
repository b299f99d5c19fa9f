"""The built-in policy modules, ``NAME.wasm``: what ``module = "NAME"`` in a config names.

Package data, not code: found through ``importlib.resources`` (``epick.config``'s
``BUILTIN_POLICY_DIR``), so an installed wheel carries them. ``make policies``
(``python -m epick.policies_build``) regenerates them from the sources in ``policies/*/``;
the builds are committed, and ``tests/policies/test_build.py`` fails when one is stale.
"""
