"""Unloading done right, for the model kinds agents keep in VRAM.

Pass one as ``unload=`` to ``gpulock.resident``; each receives the model::

    h = gpulock.resident("qwen-7b", load=lambda: Llama(path, n_gpu_layers=-1),
                         unload=adapters.unload_llama)

Neither imports torch or llama_cpp: they work on the object they are given.
"""

from __future__ import annotations

import gc
from typing import Any

from gpulock.core.devices import TorchMemory, torch_memory


def unload_llama(llm: Any) -> None:
    """A llama-cpp-python ``Llama``: ``close()`` frees its weights and context at once."""
    close = getattr(llm, "close", None)
    if close is not None:
        close()


def unload_torch(module: Any, device_index: int = 0) -> TorchMemory | None:
    """A torch module: move it to the CPU, drop cached blocks, report what is still reserved.

    Moving the parameters off the GPU and collecting garbage frees the tensors; the caching
    allocator keeps their blocks until ``empty_cache()``, so that runs last.  The caller must
    drop its own references too (the registry drops its own).  Returns the device's torch
    statistics afterwards (None without CUDA): ``reserved_bytes`` is what the process still
    holds.
    """
    to = getattr(module, "to", None)
    if to is not None:
        to("cpu")
    del module
    gc.collect()
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()
    return torch_memory(device_index)


def unload_callable(release: Any) -> None:
    """Any object with ``close()``, ``release()`` or ``unload()``, or a plain callable."""
    for name in ("close", "release", "unload"):
        method = getattr(release, name, None)
        if callable(method):
            method()
            return
    if callable(release):
        release()
