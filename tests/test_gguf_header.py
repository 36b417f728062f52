"""gpulock.core.gguf and gpulock.router.gguf_cache on headers as big as a real model's.

A real tokenizer (Qwen2.5: 151,936 tokens, 151,387 merges) is most of a GGUF header.  The VRAM
estimate needs four numbers: the reader must not touch the tokenizer's items (it made every
``gpulock route`` 333 ms slower), and a cron process must find the numbers in the state folder.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpulock.core import gguf as gguf_info
from gpulock.core.settings import Settings, load
from gpulock.router import gguf_cache
from gpulock.router.tiny_model import write_big_header

QWEN7B = {"architecture": "qwen2", "block_count": 28, "embedding_length": 3584}


@pytest.fixture(scope="module")
def headers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {
        "converter": write_big_header(d / "qwen.gguf"),
        "tokenizer-first": write_big_header(d / "worst.gguf", tokenizer_first=True),
    }


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load(None, tmp_path / "state")


class CountingFile(io.BufferedReader):
    """A file that counts the reads and seeks made on it."""

    calls = 0

    def read(self, n: int | None = -1, /) -> bytes:
        self.calls += 1
        return super().read(n)

    def seek(self, pos: int, whence: int = 0, /) -> int:
        self.calls += 1
        return super().seek(pos, whence)


def parse_counting(path: Path) -> tuple[gguf_info.GGUFInfo, int]:
    f = CountingFile(io.FileIO(path, "rb"))
    with f:
        info = gguf_info._parse(f, str(path), path.stat().st_size)
    return info, f.calls


@pytest.mark.parametrize("order", ["converter", "tokenizer-first"])
def test_the_numbers_come_out_of_a_real_sized_header(headers: dict[str, Path], order: str) -> None:
    info = gguf_info.read_info(str(headers[order]))
    assert {k: getattr(info, k) for k in QWEN7B} == QWEN7B
    assert (info.head_count, info.head_count_kv) == (28, 4)


@pytest.mark.parametrize("order", ["converter", "tokenizer-first"])
def test_the_tokenizer_items_are_not_read_one_by_one(headers: dict[str, Path], order: str) -> None:
    # The old reader made a read and a seek for each of the 303,323 strings.
    _info, calls = parse_counting(headers[order])
    assert calls < 200, calls


def test_a_header_cut_inside_the_tokenizer_still_gives_the_numbers(
    headers: dict[str, Path], tmp_path: Path
) -> None:
    # Converter order: the numbers come first; what follows is never needed (the old reader
    # walked on and called the file damaged).
    data = headers["converter"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 3])
    assert gguf_info.read_info(str(cut)).block_count == 28
    # Tokenizer first: the numbers are past the cut, so the header is damaged.
    data = headers["tokenizer-first"].read_bytes()
    for end in (len(data) // 3, len(data) // 3 + 3, len(data) - 200):
        cut.write_bytes(data[:end])
        with pytest.raises(gguf_info.GGUFError, match="ends early"):
            gguf_info.read_info(str(cut))


def test_the_state_folder_caches_the_numbers(
    headers: dict[str, Path], tmp_path: Path, settings: Settings
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(headers["converter"].read_bytes())
    first = gguf_cache.read_info_cached(settings, str(model))
    doc = json.loads((settings.state_dir / "router" / "gguf.json").read_text())
    assert doc["version"] == 1 and doc["models"][str(model)]["block_count"] == 28
    # Same size and mtime, other bytes: a new process must take the cache's word for it...
    st = model.stat()
    model.write_bytes(b"\0" * st.st_size)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    gguf_info._cache.clear()
    assert gguf_cache.read_info_cached(settings, str(model)) == first
    # ...and a changed file is read again.
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(gguf_info.GGUFError):
        gguf_cache.read_info_cached(settings, str(model))


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        json.dumps({"version": 99, "models": {}}).encode(),
        json.dumps({"version": 1, "models": []}).encode(),
        b"SYMLINK",
    ],
)
def test_a_damaged_cache_is_a_miss(
    headers: dict[str, Path], settings: Settings, tmp_path: Path, content: bytes
) -> None:
    folder = settings.state_dir / "router"
    folder.mkdir(mode=0o700, exist_ok=True)
    cache = folder / "gguf.json"
    if content == b"SYMLINK":
        target = tmp_path / "elsewhere.json"
        target.write_text("{}")
        cache.symlink_to(target)
    else:
        cache.write_bytes(content)
    gguf_info._cache.clear()
    info = gguf_cache.read_info_cached(settings, str(headers["converter"]))
    assert info.block_count == 28


def bad_entry(path: Path, **change: Any) -> dict[str, Any]:
    st = path.stat()
    entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "architecture": "qwen2"}
    entry.update(block_count=28, embedding_length=3584, head_count=28, head_count_kv=4)
    entry.update(change)
    return {"version": 1, "models": {str(path): entry}}


@pytest.mark.parametrize(
    "change",
    [{"block_count": -1}, {"block_count": "28"}, {"architecture": 5}, {"head_count": True}],
)
def test_a_cache_entry_of_the_wrong_types_is_a_miss(
    headers: dict[str, Path], settings: Settings, change: dict[str, Any]
) -> None:
    path = headers["converter"]
    folder = settings.state_dir / "router"
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / "gguf.json").write_text(json.dumps(bad_entry(path, **change)))
    gguf_info._cache.clear()
    info = gguf_cache.read_info_cached(settings, str(path))
    assert (info.block_count, info.architecture, info.head_count) == (28, "qwen2", 28)
