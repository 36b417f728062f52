"""A tenant that misbehaves, as the test asks (``mode``): ``500``, ``garbage`` (200 with a
body that is not JSON), ``hang`` (no answer for ``hang_s``), ``file`` (a static file server's
answer: a text file where JSON was expected), ``list`` (JSON, but a list where an object is
expected), ``echo`` (a 500 whose page echoes the request's Authorization header, as a careless
proxy would).  Follows no server's API on purpose."""

from __future__ import annotations

import threading
from typing import Any

from standins.base import StandIn


class Bad(StandIn):
    def __init__(self, mode: str, hang_s: float = 5.0) -> None:
        super().__init__()
        self.mode = mode
        self.hang_s = hang_s
        self._unhang = threading.Event()  # stop() ends a hang at once

    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        if self.mode == "500":
            return 500, "Internal Server Error: panic: runtime error"
        if self.mode == "garbage":
            return 200, '{"models": [ {"name": \x00\x01 not json'
        if self.mode == "hang":
            self._unhang.wait(self.hang_s)
            return 200, {}
        if self.mode == "file":
            return 200, "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1::/usr/sbin\n"
        if self.mode == "echo":
            return (
                500,
                f"bad gateway; request had Authorization: {self.last_headers.get('Authorization')}",
            )
        if self.mode == "list":
            return 200, [1, 2, 3]
        return 404, "not found"

    def stop(self) -> None:
        self._unhang.set()
        super().stop()
