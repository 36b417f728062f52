"""The owner of resident models in tests/test_residents.py: a real process, driven by its stdin.

Run as ``python tests/resident_child.py '<json options>'``; the options::

    {"audit": PATH,                 # where this process says what it did (one line per event)
     "residents": [{"name": "big", "bytes": "6GiB", "policy": "persistent", "gpu": 0,
                    "weights_mb": 20,           # a bytearray standing for the weights
                    "llama": PATH}],            # or: a real llama.cpp model (GGUF file)
     "sleep_s": 30, "busy_s": 30}   # how long "sleep" and "busy" last at most

It registers every resident with ``gpulock.resident`` (the state folder, config and simulated
GPUs come from the environment the test set), then writes ``ready``.  Commands, one per line:

* ``use NAME``: enter ``use()`` and stay inside (the main thread goes on reading commands);
  ``done NAME`` leaves it.  ``complete NAME`` runs one real completion on a llama model in use.
* ``await-evicting NAME``: wait until an eviction request for NAME has reached the owner and
  waits for the model to leave use (a test-only peek at the handle's ``_evicting`` flag).
* ``sleep``: the main thread blocks in ``time.sleep``; ``busy``: it spins in pure Python.
  Either way only the background thread can answer an eviction.
* ``release NAME``, ``state NAME``, ``exit``.

Audit lines are written with one ``write()`` on an ``O_APPEND`` descriptor::

    <kind> <name or -> <JSON object>

``unloaded NAME`` is written by the unload callable, inside the owner, after the weights are
cleared (for llama: after ``gpulock.adapters.unload_llama`` closed the model).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

POLL_S = 0.005


class Audit:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, kind: str, name: str = "-", **extra: Any) -> None:
        os.write(self.fd, f"{kind} {name} {json.dumps(extra)}\n".encode())


class Weights:
    """Stands for a model's weights: a real allocation the unload must give back."""

    def __init__(self, name: str, mb: int) -> None:
        self.name = name
        self.data = bytearray(mb * 1024 * 1024)


def read_line() -> str:
    """One line from stdin, unbuffered (so nothing is read ahead of a blocking command)."""
    line = b""
    while not line.endswith(b"\n"):
        ch = os.read(0, 1)
        if not ch:
            break
        line += ch
    return line.decode().strip()


def register(spec: dict[str, Any], audit: Audit) -> Any:
    import gpulock

    name = spec["name"]
    kw: dict[str, Any] = {
        "gpu": spec.get("gpu", 0),
        "bytes": spec.get("bytes"),
        "policy": spec.get("policy", "persistent"),
    }
    if spec.get("llama"):
        import llama_cpp

        llm = llama_cpp.Llama(spec["llama"], n_ctx=128, n_gpu_layers=0, verbose=False)
        closed: list[bool] = []
        real_close = llm.close

        def close() -> None:  # shadows the method: proves unload_llama called close()
            real_close()
            closed.append(True)

        llm.close = close  # type: ignore[method-assign]

        def unload_llm(model: Any) -> None:
            gpulock.adapters.unload_llama(model)
            inner = getattr(model, "_model", None)
            audit.write(
                "unloaded",
                name,
                closed=bool(closed),
                model_freed=inner is not None and getattr(inner, "model", 1) is None,
            )

        return gpulock.resident(name, model=llm, unload=unload_llm, **kw)

    def unload(model: Weights) -> None:
        size = len(model.data)
        model.data.clear()
        audit.write("unloaded", model.name, freed=size, left=len(model.data))

    weights = Weights(name, int(spec.get("weights_mb", 20)))
    return gpulock.resident(name, model=weights, unload=unload, **kw)


def main(opts: dict[str, Any]) -> int:
    audit = Audit(opts["audit"])
    handles = {spec["name"]: register(spec, audit) for spec in opts["residents"]}
    inside: dict[str, tuple[Any, Any]] = {}  # name -> (the use() context, the model)
    audit.write("ready", pid=os.getpid(), ids={n: h.id for n, h in handles.items()})
    while True:
        line = read_line()
        if not line or line == "exit":
            return 0
        cmd, _, name = line.partition(" ")
        try:
            if cmd == "use":
                cm = handles[name].use()
                inside[name] = (cm, cm.__enter__())
                audit.write("entered", name)
            elif cmd == "complete":
                out = inside[name][1].create_completion("hello", max_tokens=4)
                audit.write("completed", name, usage=out["usage"])
            elif cmd == "done":
                cm, _model = inside.pop(name)
                audit.write("leaving", name)
                cm.__exit__(None, None, None)
                audit.write("left", name)
            elif cmd == "await-evicting":
                deadline = time.monotonic() + 10
                while not handles[name]._evicting and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                audit.write("evicting", name, seen=handles[name]._evicting)
            elif cmd == "sleep":
                audit.write("sleeping")
                time.sleep(float(opts.get("sleep_s", 30)))
                audit.write("woke")
            elif cmd == "busy":
                audit.write("spinning")
                end = time.monotonic() + float(opts.get("busy_s", 30))
                n = 0
                while n % 10_000 or time.monotonic() < end:
                    n += 1
                audit.write("spun", loops=n)
            elif cmd == "release":
                handles[name].release()
                audit.write("released", name)
            elif cmd == "state":
                h = handles[name]
                audit.write("state", name, loaded=h.loaded, evictions=h.evictions)
            else:
                audit.write("error", name, message=f"unknown command {line!r}")
        except Exception as e:
            audit.write("error", name, type=type(e).__name__, message=str(e))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(json.loads(sys.argv[1])))
