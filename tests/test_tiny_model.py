"""gpulock.router.tiny_model: a real (tiny, random) llama GGUF that llama.cpp loads, tokenizes and
runs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulock.router.tiny_model import (
    BOS_ID,
    BYTE0_ID,
    EOS_ID,
    N_VOCAB,
    SPACE_ID,
    TINY_LLAMA_NAME,
    UNK_ID,
    ensure_tiny_llama,
    write_tiny_llama,
)

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = write_tiny_llama(tmp_path / "a.gguf", seed=7)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=7)
    c = write_tiny_llama(tmp_path / "c.gguf", seed=8)
    assert a == tmp_path / "a.gguf"
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert a.stat().st_size == c.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temps


def test_size_is_about_half_a_megabyte(model_path: Path) -> None:
    assert 400_000 < model_path.stat().st_size < 600_000


def test_overwrite_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a model")
    write_tiny_llama(path, seed=1)
    assert path.read_bytes()[:4] == b"GGUF"


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="n_head"):
        write_tiny_llama(tmp_path / "m.gguf", n_embd=64, n_head=5)
    with pytest.raises(ValueError, match="n_layer"):
        write_tiny_llama(tmp_path / "m.gguf", n_layer=0)
    assert list(tmp_path.iterdir()) == []


def test_ensure_writes_once_and_rewrites_a_broken_file(tmp_path: Path) -> None:
    path = ensure_tiny_llama(tmp_path)
    assert path == tmp_path / TINY_LLAMA_NAME
    first = path.stat()
    assert ensure_tiny_llama(tmp_path).stat().st_ino == first.st_ino  # reused, not rewritten
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # truncated
    assert ensure_tiny_llama(tmp_path).read_bytes() == good


def _scalar(reader: Any, key: str) -> Any:
    field = reader.fields[key]
    value = field.parts[field.data[0]]
    if field.types[0] == gguf.GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0]


def test_metadata_reads_back(model_path: Path) -> None:
    reader = gguf.GGUFReader(model_path)
    assert _scalar(reader, "general.architecture") == "llama"
    assert _scalar(reader, "llama.block_count") == 2
    assert _scalar(reader, "llama.embedding_length") == 64
    assert _scalar(reader, "llama.attention.head_count") == 4
    assert _scalar(reader, "llama.attention.head_count_kv") == 4
    assert _scalar(reader, "llama.rope.dimension_count") == 16
    assert _scalar(reader, "tokenizer.ggml.model") == "llama"
    assert _scalar(reader, "tokenizer.ggml.bos_token_id") == BOS_ID
    assert _scalar(reader, "tokenizer.ggml.eos_token_id") == EOS_ID
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == N_VOCAB == 260
    text = [bytes(tokens.parts[i]).decode("utf-8") for i in tokens.data]
    assert text[UNK_ID] == "<unk>"
    assert text[BYTE0_ID + 0x41] == "<0x41>"
    assert text[SPACE_ID] == "\u2581"
    types = reader.fields["tokenizer.ggml.token_type"]
    assert [types.parts[i].tolist()[0] for i in types.data].count(gguf.TokenType.BYTE) == 256
    # GGUF shapes are ggml's ne (fastest dimension first): what llama.cpp checks on load.
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert len(shapes) == 2 + 2 * 9 + 1
    assert shapes["token_embd.weight"] == [64, N_VOCAB]
    assert shapes["output.weight"] == [64, N_VOCAB]
    assert shapes["blk.1.attn_q.weight"] == [64, 64]
    assert shapes["blk.1.ffn_gate.weight"] == [64, 128]
    assert shapes["blk.1.ffn_down.weight"] == [128, 64]
    assert shapes["blk.0.attn_norm.weight"] == [64]


def test_command_line_writes_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "gpulock.router.tiny_model", str(out), "--seed", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == f"{out} {out.stat().st_size} bytes"
    assert out.read_bytes() == write_tiny_llama(tmp_path / "api.gguf", seed=3).read_bytes()


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[Any]:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(
        model_path=str(model_path), n_ctx=256, n_gpu_layers=0, verbose=False, seed=0
    )
    try:
        yield model
    finally:
        model.close()


def test_llama_cpp_tokenizes_text_into_byte_tokens(llm: Any) -> None:
    assert llm.n_vocab() == N_VOCAB
    assert llm.token_bos() == BOS_ID
    assert llm.token_eos() == EOS_ID
    hi = [SPACE_ID, BYTE0_ID + ord("h"), BYTE0_ID + ord("i")]
    assert llm.tokenize(b"hi", add_bos=False) == hi
    assert llm.tokenize(b"hi") == [BOS_ID, *hi]
    assert llm.tokenize("é".encode(), add_bos=False) == [SPACE_ID, BYTE0_ID + 0xC3, BYTE0_ID + 0xA9]
    assert llm.detokenize([BYTE0_ID + ord("h"), BYTE0_ID + ord("i")]) == b"hi"


def _printable(text: str) -> bool:
    return all(" " <= c <= "~" for c in text)


def test_llama_cpp_completes(llm: Any) -> None:
    out = llm.create_completion("hello", max_tokens=16)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(llm.tokenize(b"hello")) == 7
    assert out["usage"]["completion_tokens"] == 16
    assert 0 < len(choice["text"]) <= 16
    assert _printable(choice["text"])


@pytest.mark.parametrize("temperature", [0.0, 0.8, 2.0])
def test_llama_cpp_generates_printable_ascii_to_max_tokens(llm: Any, temperature: float) -> None:
    # Unfiltered sampling: only the weights keep </s> and non-ASCII bytes out (_steer_to_ascii).
    for seed in range(5):
        out = llm.create_completion(
            "é€ \x00",
            max_tokens=12,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            seed=seed,
        )
        assert out["usage"]["completion_tokens"] == 12
        assert out["choices"][0]["finish_reason"] == "length"
        assert _printable(out["choices"][0]["text"])


def test_llama_cpp_chats(llm: Any) -> None:
    out = llm.create_chat_completion(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ],
        max_tokens=8,
    )
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert _printable(choice["message"]["content"])
    assert choice["finish_reason"] == "length"
    # "<s>system: Be brief.\nuser: hi\nassistant:" from the template in the file, one byte a token
    prompt = "system: Be brief.\nuser: hi\nassistant:"
    assert out["usage"]["prompt_tokens"] == len(llm.tokenize(prompt.encode()))
    assert out["usage"]["completion_tokens"] == 8


def test_llama_cpp_loads_and_closes(model_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(
        model_path=str(model_path), n_ctx=64, n_gpu_layers=0, verbose=False, seed=1
    )
    assert model.metadata["general.architecture"] == "llama"
    assert model.n_ctx() >= 64  # llama.cpp rounds the context up (to 256 in 0.3.36)
    model.close()
    model.close()  # a second close is harmless
