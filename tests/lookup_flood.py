"""A client process that floods a daemon with lookups: ``python -m tests.lookup_flood SOCKET TOKENS INFLIGHT
CONNECTIONS`` keeps INFLIGHT lookups of TOKENS tokens each in flight on each of CONNECTIONS connections until it is
killed; it prints "ready" once each connection had answers."""

from __future__ import annotations

import sys
import threading

from spilld import format as fmt
from spilld import protocol as P
from tests.wire import Wire


def flood(path: str, ntokens: int, inflight: int, answered: threading.Barrier) -> None:
    w = Wire(path)
    w.hello(client="flood")
    params = {"identity": {"model_id": "flood"}, "tokens": fmt.encode_tokens(list(range(ntokens)))}
    ids = iter(range(1_000, 1 << 62))
    w.send(*[P.request(next(ids), "lookup", params) for _ in range(inflight)])
    said = False
    while True:
        assert w._read(), "the daemon closed the flood's connection"
        n, w.inbox = len(w.inbox), []
        if n and not said:
            answered.wait()
            said = True
        w.send(*[P.request(next(ids), "lookup", params) for _ in range(n)])


def main() -> None:
    path, ntokens, inflight, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    answered = threading.Barrier(conns + 1)
    for _ in range(conns):
        threading.Thread(target=flood, args=(path, ntokens, inflight, answered), daemon=True).start()
    answered.wait()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
