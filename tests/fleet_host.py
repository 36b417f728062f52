"""A model host for tests/test_foresight_e2e.py: a real process that keeps models resident.

Run as ``python tests/fleet_host.py SOCKET BYTES``.  Each connection to the unix socket SOCKET
sends ``MODEL AGENT\\n``; the host uses MODEL for AGENT (registering it with
``gpulock.resident`` on first use, declared BYTES; reloaded through ``load=`` when it was
evicted meanwhile), writes the ``call`` event a router would, and answers ``ok\\n``.  Every
load (first or re-) is a ``resident`` event.  It writes ``ready`` on stdout once listening.
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any

import gpulock
from gpulock.core import settings as settings_mod


def main() -> None:
    path, size = sys.argv[1], sys.argv[2]
    settings = settings_mod.load()
    handles: dict[str, Any] = {}
    lock = threading.Lock()

    def serve(conn: socket.socket) -> None:
        with conn:
            model, agent = conn.makefile().readline().split()
            with lock:
                h = handles.get(model)
                if h is None:
                    h = handles[model] = gpulock.resident(
                        model, bytes=size, load=lambda: bytearray(1 << 20), unload=lambda m: None
                    )
            with h.use():
                settings.emit("call", agent=agent, model=model, tier="gpu", ok=True)
            conn.sendall(b"ok\n")

    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
