"""Regenerate the gRPC stubs in host/api/gen/ from proto/ (``make proto``).

The stubs are committed and never hand-edited. protoc writes absolute imports
(``from epick.v1 import picker_pb2``); they are rewritten to live under
``epick.api.gen`` so that the proto package name does not collide with ours.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto"
OUT = Path(__file__).resolve().parent / "gen"


def main() -> int:
    files = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "epick" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{PROTO}", f"--python_out={OUT}", f"--grpc_python_out={OUT}",
            f"--pyi_out={OUT}", *files]
    if protoc.main(args) != 0:
        print(f"protoc failed: {' '.join(args)}", file=sys.stderr)
        return 1
    for path in (OUT / "epick" / "v1").glob("*.py*"):
        text = path.read_text()
        path.write_text(re.sub(r"^from epick\.v1 import", "from epick.api.gen.epick.v1 import",
                               text, flags=re.M))
    for pkg in (OUT / "epick", OUT / "epick" / "v1"):
        (pkg / "__init__.py").touch()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
