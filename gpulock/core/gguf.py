"""What a GGUF file says about its model's size, read from the header alone, and a VRAM estimate.

A GGUF file starts with ``GGUF``, a version, the tensor and key/value counts, then the key/value
metadata.  We read only the few numbers a VRAM estimate needs (layers, width, heads) and stop
as soon as we have them: llama.cpp's converter writes them before the tokenizer, whose arrays
(Qwen2.5: 151,936 tokens and 151,387 merges) are then never read.  When a file puts them after
the tokenizer, arrays are skipped without touching their items: a string array by walking its
length prefixes in large buffered reads (``_skip_strings``), a fixed-size one by one seek.  So a
header costs well under a millisecond (tens of ms for the worst order) and imports nothing: the
``gguf`` package would pull in numpy and memory-map the whole file.
``gpulock/router/gguf_cache.py`` keeps the result in the state folder, so a cron process does not
parse the header again.

The estimate, for ``n_gpu_layers`` of ``block_count`` layers offloaded::

    weights  = file size x offloaded share
    kv cache = 2 (K and V) x layers offloaded x n_ctx x n_embd x head_count_kv / head_count x 2 B
    compute  = COMPUTE_BASE + n_ctx x n_embd x 4 B x 4   (llama.cpp's scratch buffers, roughly)

It is deliberately a little generous: the lock's ``need`` is a promise to the other agents, and
an under-estimate is the one that ends in an out-of-memory error.  ``vram:`` in a route overrides
it when you have measured the real figure (``gpulock status`` shows what NVML saw).
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"GGUF"
COMPUTE_BASE = 64 * 1024**2
KV_BYTES = 2  # f16 K and V caches, llama.cpp's default

# GGUF value types: fixed sizes; 8 is a string, 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRUCT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_STRUCT.update({10: "<Q", 11: "<q", 12: "<d"})
_STRING, _ARRAY = 8, 9
_WANTED = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv")
_MAX_KEY = 1 << 16
_MAX_NESTING = 8  # arrays of arrays: llama.cpp writes one level; deeper is a damaged header
_CHUNK = 1 << 20  # bytes read at a time while walking a string array's length prefixes
_U64 = struct.Struct("<Q")


class GGUFError(ValueError):
    """The file is not a GGUF file we can read."""


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    path: str
    file_bytes: int
    architecture: str | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None


_cache: dict[tuple[str, int, int], GGUFInfo] = {}


def read_info(path: str) -> GGUFInfo:
    """The header numbers of a GGUF file (cached by path, size and mtime).

    GGUFError for anything that is not a readable GGUF header, a FIFO or a folder included
    (opened without blocking, then refused); OSError when the file cannot be opened.
    """
    with open(path, "rb", opener=_open_nonblocking) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise GGUFError(f"{path}: not a regular file, so not a GGUF model")
        key = (path, st.st_size, st.st_mtime_ns)
        hit = _cache.get(key)
        if hit is not None:
            return hit
        info = _parse(f, path, st.st_size)
    _cache[key] = info
    return info


_templates: dict[tuple[str, int, int], str | None] = {}
TEMPLATE_KEY = "tokenizer.chat_template"
_MAX_TEMPLATE = 1 << 20


def read_chat_template(path: str) -> str | None:
    """The model's chat template (``tokenizer.chat_template``), or None: no template, or a
    file that cannot be read as GGUF (the load will say why).  It usually sits after the
    tokenizer's arrays, which are skipped without reading their items; cached per file."""
    try:
        with open(path, "rb", opener=_open_nonblocking) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            key = (path, st.st_size, st.st_mtime_ns)
            if key not in _templates:
                _templates[key] = _template(f, st.st_size)
            return _templates[key]
    except (OSError, GGUFError, struct.error, UnicodeDecodeError):
        return None


def _template(f: BinaryIO, size: int) -> str | None:
    if f.read(4) != MAGIC or _unpack(f, "<I") < 2:
        return None
    _unpack(f, "<Q")  # tensor count
    for _ in range(_unpack(f, "<Q")):
        key = _string(f)
        vtype = _unpack(f, "<I")
        if vtype in _FIXED:
            _skip(f, _FIXED[vtype], size)
        elif vtype == _STRING:
            if key == TEMPLATE_KEY:
                n = _unpack(f, "<Q")
                if n > _MAX_TEMPLATE:
                    return None
                _left(f, n, size)
                return f.read(n).decode("utf-8")
            _skip(f, _unpack(f, "<Q"), size)
        elif vtype == _ARRAY:
            _skip_array(f, size, 0)
        else:
            return None
    return None


def _open_nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)  # a FIFO named as the model must not hang us


def _parse(f: BinaryIO, path: str, size: int) -> GGUFInfo:
    if f.read(4) != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (no GGUF magic at the start)")
    version = _unpack(f, "<I")
    if version < 2:
        raise GGUFError(f"{path}: GGUF version {version} is too old (llama.cpp reads 2 and 3)")
    _unpack(f, "<Q")  # tensor count
    n_kv = _unpack(f, "<Q")
    values: dict[str, object] = {}
    for _ in range(n_kv):
        if _complete(values):
            break  # the rest is the tokenizer and friends: nothing a VRAM estimate needs
        key = _string(f)
        vtype = _unpack(f, "<I")
        if vtype in _STRUCT:
            values[key] = _unpack(f, _STRUCT[vtype])
        elif vtype == _STRING:
            values[key] = _string(f)
        elif vtype == _ARRAY:
            _skip_array(f, size, 0)
        else:
            raise GGUFError(f"{path}: unknown GGUF value type {vtype} for {key!r}")
    arch = values.get("general.architecture")
    arch_s = arch if isinstance(arch, str) else None

    def num(name: str) -> int | None:
        v = values.get(f"{arch_s}.{name}") if arch_s else None
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    found = {name: num(name) for name in _WANTED}
    return GGUFInfo(
        path=path,
        file_bytes=size,
        architecture=arch_s,
        block_count=found["block_count"],
        embedding_length=found["embedding_length"],
        head_count=found["attention.head_count"],
        head_count_kv=found["attention.head_count_kv"] or found["attention.head_count"],
    )


def _complete(values: dict[str, object]) -> bool:
    arch = values.get("general.architecture")
    return isinstance(arch, str) and all(f"{arch}.{name}" in values for name in _WANTED)


def _unpack(f: BinaryIO, fmt: str) -> int:
    n = struct.calcsize(fmt)
    data = f.read(n)
    if len(data) != n:
        raise GGUFError(f"{f.name}: the GGUF header ends early")
    value: int = struct.unpack(fmt, data)[0]
    return value


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "<Q")
    if n > _MAX_KEY * 16:
        raise GGUFError(f"{f.name}: a GGUF string of {n} bytes: the header is damaged")
    data = f.read(n)
    if len(data) != n:
        raise GGUFError(f"{f.name}: the GGUF header ends early")
    return data.decode("utf-8", "replace")


def _left(f: BinaryIO, n: int, size: int) -> None:
    """Raise GGUFError unless ``n`` more bytes are there: a damaged count must neither seek to
    anywhere nor loop billions of times."""
    if n > size - f.tell():
        raise GGUFError(f"{f.name}: the GGUF header ends early")


def _skip(f: BinaryIO, n: int, size: int) -> None:
    _left(f, n, size)
    f.seek(n, os.SEEK_CUR)


def _skip_array(f: BinaryIO, size: int, depth: int) -> None:
    if depth >= _MAX_NESTING:
        raise GGUFError(f"{f.name}: GGUF arrays nested {depth} deep: the header is damaged")
    itype = _unpack(f, "<I")
    count = _unpack(f, "<Q")
    if itype in _FIXED:
        _skip(f, _FIXED[itype] * count, size)
    elif itype == _STRING:
        _left(f, 8 * count, size)  # each string has its 8-byte length at least
        _skip_strings(f, count, size)
    elif itype == _ARRAY:
        _left(f, 12 * count, size)  # each array has its type and count at least
        for _ in range(count):
            _skip_array(f, size, depth + 1)
    else:
        raise GGUFError(f"{f.name}: unknown GGUF array type {itype}")


def _skip_strings(f: BinaryIO, count: int, size: int) -> None:
    """Skip ``count`` length-prefixed strings: only their 8-byte lengths are looked at, in
    buffers of ``_CHUNK`` bytes (one read per megabyte, not a read and a seek per string)."""
    unpack = _U64.unpack_from
    base = f.tell()  # file offset of buf[0]
    buf = f.read(_CHUNK)
    i = 0
    done = 0
    while done < count:
        k = done
        try:
            # The hot loop: one unpack and one add per string (~0.1 us).  A length not wholly
            # in the buffer raises struct.error before item k is counted: k says where to resume.
            for k in range(done, count):  # noqa: B007
                i += 8 + unpack(buf, i)[0]
            done = count
        except struct.error:
            done = k
            base += i  # read on from item k's length
            if base > size - 8:
                raise GGUFError(f"{f.name}: the GGUF header ends early") from None
            f.seek(base)
            buf = f.read(_CHUNK)
            if len(buf) < 8:
                raise GGUFError(f"{f.name}: the GGUF header ends early") from None  # shrunk
            i = 0
    if base + i > size:
        raise GGUFError(f"{f.name}: the GGUF header ends early")
    f.seek(base + i)


def estimate_vram(info: GGUFInfo, *, n_ctx: int, n_gpu_layers: int) -> int:
    """Bytes of VRAM a llama.cpp model takes with this context and offload (see module doc)."""
    layers = info.block_count
    if n_gpu_layers == 0:
        return 0
    share = 1.0
    offloaded = layers
    if layers is not None and 0 < n_gpu_layers < layers:
        share = n_gpu_layers / layers
        offloaded = n_gpu_layers
    weights = int(info.file_bytes * share)
    kv = 0
    compute = COMPUTE_BASE
    if offloaded and info.embedding_length and info.head_count and info.head_count_kv:
        kv_width = info.embedding_length * info.head_count_kv // info.head_count
        kv = 2 * offloaded * n_ctx * kv_width * KV_BYTES
        compute += n_ctx * info.embedding_length * 4 * 4
    return weights + kv + compute
