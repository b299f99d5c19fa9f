"""Front-end worker processes (``[server] workers`` > 1): ext_proc on every core, one
decision core.

    the service's process                         N worker processes (SO_REUSEPORT)
      Hub  <── one Unix socket per worker ──>      RemoteDecider + the ext_proc server
      (Decider: policies, in-flight counts,        (streams, body chunks, OpenAI parsing,
       the decision log, flow control)              usage/TTFT, protobuf encode/decode)
      Workers: starts, restarts and stops them

Only the decision crosses the socket: a serialized ``PickRequest`` (and its subset hint)
one way, the verdict (endpoint, fallbacks, decision id, or the refusal) the other;
completions and the workers' own refusals (a malformed body) go one way. Frames are
msgpack (:mod:`epick.frontend.wire`). The service's process stays the only one that
decides, so decisions are the same with one worker or many (tests/frontend/).

``[server] frontend = "native"``: the workers are ``native/epick-extproc`` (C++, ``make
native``) instead, serving ext_proc only. They send the request's headers and body
(``PickHttp``); the hub reads and decides them with ext_proc.py's own code and answers
with the serialized responses (``Routed``), so both front ends answer alike.
"""

from epick.frontend.hub import Hub
from epick.frontend.supervisor import Workers

__all__ = ["Hub", "Workers"]
