"""One streamed answer chunk through ext_proc (FULL_DUPLEX_STREAMED): µs per chunk, the
code as it was before the per-chunk trim beside the code as it is, in one run.

    epick bench ext-proc-chunk [--chunks 20000] [--size 150] [--repeat 5]

Per chunk, both sides do what a worker does with Envoy's ``response_body`` message: parse
the ``ProcessingRequest`` from its bytes (gRPC's deserializer), answer it through the
stream's dispatch (usage/TTFT read from the SSE event), and serialize the answer (gRPC's
serializer). ``before`` is the earlier path kept here verbatim: the body read out of the
message twice, the SSE reader's copy of every chunk, and five messages built and
serialized per chunk, behind four other message kinds in the dispatch; ``after`` is
:meth:`epick.api.ext_proc._Stream.handle` today.
The chunks are vLLM-like SSE events (one whole event a chunk), the last carrying usage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from epick.api import ext_proc
from epick.api.usage import MAX_LINE_BYTES, UsageReader

_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


class _LegacyUsage(UsageReader):
    """The SSE reader before the trim: every chunk joined to the tail and sliced."""

    def _feed_sse(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._tail = data if len(data) <= MAX_LINE_BYTES else b""
            return
        complete, self._tail = data[:cut], data[cut + 1:]
        if b'"usage"' in complete:
            for line in complete.split(b"\n"):
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._event(line[5:])


def _legacy_response_body(stream, body: ep.HttpBody) -> ep.ProcessingResponse:
    """``_Stream._response_body`` before the trim."""
    if stream.usage is not None:
        stream.usage.feed(body.body, time.perf_counter())
    if body.end_of_stream:
        stream.response_done = True
    if stream.response_mode == _DUPLEX:
        return ext_proc._streamed_message("response", body.body, body.end_of_stream)
    return ep.ProcessingResponse(response_body=ep.BodyResponse())


def _legacy_handle(stream, msg: ep.ProcessingRequest):
    # The dispatch in front of it is unchanged (the same field checks, in the same order).
    if msg.HasField("metadata_context"):
        stream._read_metadata(msg.metadata_context)
    kind = msg.WhichOneof("request")
    if kind in ("request_headers", "request_body", "request_trailers", "response_headers"):
        raise AssertionError(kind)  # the four tests handle() made before this one
    if kind == "response_body":
        return [_legacy_response_body(stream, msg.response_body)]
    raise AssertionError(kind)


def _events(count: int, size: int) -> list[bytes]:
    pad = "x" * max(0, size - 40)
    out = [b'data: {"choices":[{"index":0,"text":"%s%d"}]}\n\n' % (pad.encode(), i)
           for i in range(count - 1)]
    out.append(b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":%d}}'
               b"\n\n" % count)
    return out


class _Svc:
    """What a stream reads of its service on the response path."""

    def __init__(self) -> None:
        from epick.config import ExtProcConfig

        self.config = ExtProcConfig()
        self.scheduler = None
        self.decider = None


def _stream(legacy: bool):
    stream = ext_proc._Stream(_Svc())
    stream.duplex = True
    stream.response_mode = _DUPLEX
    stream.status = 200
    stream.response_started = True
    reader = _LegacyUsage if legacy else UsageReader
    stream.usage = reader("text/event-stream", time.perf_counter())
    return stream


def run(wire: list[bytes], legacy: bool) -> float:
    """µs per chunk: parse, handle, serialize every message of one answer."""
    parse = ep.ProcessingRequest.FromString
    serialize = ext_proc._serialize
    stream = _stream(legacy)
    handle = (lambda m: _legacy_handle(stream, m)) if legacy else stream.handle
    last = len(wire) - 1
    t0 = time.perf_counter()
    for i, raw in enumerate(wire):
        msg = parse(raw)
        if i == last:  # the end: reported once (off the per-chunk path being measured)
            stream.reported = True
        for out in handle(msg):
            serialize(out)
    elapsed = time.perf_counter() - t0
    usage = stream.usage
    usage.finish()
    assert usage.completion_tokens == len(wire), "usage was not read"
    return elapsed / len(wire) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epick bench ext-proc-chunk",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=20_000, help="chunks per answer")
    ap.add_argument("--size", type=int, default=150, help="bytes per SSE event")
    ap.add_argument("--repeat", type=int, default=5, help="runs per side (median)")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args(argv)
    wire = [ep.ProcessingRequest(response_body=ep.HttpBody(
        body=e, end_of_stream=i == args.chunks - 1)).SerializeToString()
            for i, e in enumerate(_events(args.chunks, args.size))]
    sides: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(args.repeat):  # interleaved, so machine noise hits both alike
        sides["before"].append(run(wire, legacy=True))
        sides["after"].append(run(wire, legacy=False))
    report = {"chunks": args.chunks, "size": args.size, "repeat": args.repeat}
    for side, xs in sides.items():
        report[side] = {"median_us": round(statistics.median(xs), 3),
                        "min_us": round(min(xs), 3)}
        print(f"{side:<7} {statistics.median(xs):7.2f} µs/chunk median "
              f"(min {min(xs):.2f}) over {args.repeat} x {args.chunks} chunks of "
              f"{args.size} B")
    ratio = report["after"]["median_us"] / report["before"]["median_us"]
    report["after_over_before"] = round(ratio, 3)
    print(f"after / before: {ratio:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
