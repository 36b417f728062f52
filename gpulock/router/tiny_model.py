"""A tiny, real llama-architecture GGUF model with random weights, written on the spot.

It exists so that tests and ``make demo`` can make *real* llama.cpp calls (load a model, tokenize,
generate, chat, serve it with ``python -m llama_cpp.server``) on any machine, with no download and
no GPU: the file is about half a megabyte and loads and generates in milliseconds on one CPU core.

It is not a useful model.  The weights are seeded random numbers, so what it generates is
nonsense; only the shapes, the metadata and the tokenizer are right.  One channel of the weights is
set by hand so that it only ever generates printable ASCII and spaces, never ``</s>`` (see
``_steer_to_ascii``): every completion is valid UTF-8 and exactly ``max_tokens`` tokens long.

The vocabulary is the smallest byte-level SentencePiece (SPM) one that llama.cpp accepts:
``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>`` .. ``<0xFF>`` and ``▁`` (U+2581,
SPM's space).  Any text tokenizes: a leading ``▁``, ``▁`` for each space and one byte token for
every other UTF-8 byte.  The file also carries a trivial chat template (``CHAT_TEMPLATE``).

Writing needs ``gguf`` and ``numpy`` (the ``llama`` extra); both are imported inside the functions,
so importing this module costs nothing.  Command line::

    python -m gpulock.router.tiny_model OUT.gguf [--seed N]
"""

from __future__ import annotations

import os
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Any

TINY_LLAMA_NAME = "tiny-llama.gguf"

# Token ids of the vocabulary (see the module docstring).
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE0_ID = 3  # the token of byte b is BYTE0_ID + b
SPACE_ID = BYTE0_ID + 256  # "▁"
N_VOCAB = SPACE_ID + 1  # 260

# Turn-by-turn "role: content" lines, then "assistant:".  A template in the file makes
# llama-cpp-python format chats with it (as it does for real models) instead of falling back to
# its built-in llama-2 format; the model cannot follow any format, so the simplest one will do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Tokens the model may generate: the printable ASCII bytes and "▁".
ALLOWED_IDS = frozenset([*range(BYTE0_ID + 0x20, BYTE0_ID + 0x7F), SPACE_ID])

_GGUF_MAGIC = b"GGUF"
_WEIGHT_STD = 0.02
_RMS_EPS = 1e-5
_ROPE_FREQ_BASE = 10000.0


def _tensor_shapes(
    n_layer: int, n_embd: int, n_ff: int, n_vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and numpy shapes, in the order they are written.

    gguf's writer stores a numpy array's shape reversed (GGUF lists the fastest-varying dimension
    first, like ggml's ``ne``), so a matrix that llama.cpp checks as ``{n_in, n_out}`` is a numpy
    array of shape ``(n_out, n_in)``: one row per output unit.  Without grouped-query attention
    (kv heads == heads) q, k, v and the attention output are all ``(n_embd, n_embd)``.
    """
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, n_embd))]
    for i in range(n_layer):
        blk = f"blk.{i}"
        shapes += [
            (f"{blk}.attn_norm.weight", (n_embd,)),
            (f"{blk}.attn_q.weight", (n_embd, n_embd)),
            (f"{blk}.attn_k.weight", (n_embd, n_embd)),
            (f"{blk}.attn_v.weight", (n_embd, n_embd)),
            (f"{blk}.attn_output.weight", (n_embd, n_embd)),
            (f"{blk}.ffn_norm.weight", (n_embd,)),
            (f"{blk}.ffn_gate.weight", (n_ff, n_embd)),
            (f"{blk}.ffn_up.weight", (n_ff, n_embd)),
            (f"{blk}.ffn_down.weight", (n_embd, n_ff)),
        ]
    shapes += [("output_norm.weight", (n_embd,)), ("output.weight", (n_vocab, n_embd))]
    return shapes


def _tensor_bytes(n_layer: int, n_embd: int, n_ff: int) -> int:
    """The float32 weight bytes of a model with these sizes (a lower bound of its file size)."""
    total = 0
    for _, shape in _tensor_shapes(n_layer, n_embd, n_ff, N_VOCAB):
        count = 1
        for dim in shape:
            count *= dim
        total += 4 * count
    return total


def _steer_to_ascii(tensors: dict[str, Any]) -> None:
    """Make every token but ALLOWED_IDS unlikely by ~60 nats, whatever the input.

    With plain random weights the model picks among all 260 tokens, which is bad for tests:
    ``</s>`` ends completions at random lengths, and llama-cpp-python holds back a token that
    starts a multi-byte UTF-8 sequence until the sequence completes, skipping its ``max_tokens``
    check meanwhile, so completions of random bytes run a few tokens past ``max_tokens``.

    llama has no bias terms, so channel 0 of the residual stream plays one: every token embedding
    has 1.0 there (against ~0.02 elsewhere), which the small random layers barely move, so after
    the final RMS norm channel 0 is about sqrt(n_embd) for any prompt.  A weight of -8 on
    channel 0 in the output rows of the other tokens puts their logits ~8 * sqrt(n_embd) below.
    """
    tensors["token_embd.weight"][:, 0] = 1.0
    output = tensors["output.weight"]
    for token in range(output.shape[0]):
        if token not in ALLOWED_IDS:
            output[token, 0] = -8.0


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """Token texts, scores and types (gguf.TokenType values) of the byte-level SPM vocabulary."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
    types += [int(TokenType.BYTE)] * 256 + [int(TokenType.NORMAL)]
    scores = [0.0] * len(tokens)
    assert len(tokens) == N_VOCAB
    return tokens, scores, types


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
) -> pathlib.Path:
    """Write a tiny llama-architecture GGUF model with random weights to ``path``; return it.

    The same arguments give a byte-identical file (with the same numpy: its random streams are
    stable in practice but not promised across versions).  It only ever generates printable ASCII
    and never ``</s>`` (``_steer_to_ascii``).  The file is written next to ``path``
    under a temporary name and moved into place with ``os.replace``, so a reader (or a concurrent
    writer) never sees half a file.  With the defaults it is about 0.5 MB (float32 weights).
    """
    for name, value in (
        ("n_layer", n_layer),
        ("n_embd", n_embd),
        ("n_head", n_head),
        ("n_ff", n_ff),
        ("n_ctx_train", n_ctx_train),
    ):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    head_dim, rest = divmod(n_embd, n_head)
    if rest or head_dim % 2:
        raise ValueError(f"n_embd ({n_embd}) must be n_head ({n_head}) times an even head size")

    gguf, np = _writer_modules()

    target = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_name("gpulock tiny llama (random weights, for tests)")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_vocab_size(N_VOCAB)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_ROPE_FREQ_BASE)
    writer.add_layer_norm_rms_eps(_RMS_EPS)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    tensors: dict[str, Any] = {}
    for name, shape in _tensor_shapes(n_layer, n_embd, n_ff, N_VOCAB):
        if len(shape) == 1:  # RMS norm weights: start as the identity
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = rng.normal(0.0, _WEIGHT_STD, size=shape).astype(np.float32)
    _steer_to_ascii(tensors)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a model file is not a secret
        os.replace(tmp, target)
    except BaseException:
        writer.close()
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return target


# Qwen2.5's tokenizer: what a real GGUF header carries (bench/gguf_header.py, the tests).
QWEN_TOKENS = 151_936
QWEN_MERGES = 151_387


def write_big_header(
    path: str | os.PathLike[str],
    *,
    n_tokens: int = QWEN_TOKENS,
    n_merges: int = QWEN_MERGES,
    tokenizer_first: bool = False,
) -> pathlib.Path:
    """A GGUF file with a Qwen2.5-sized BPE tokenizer and Qwen2.5-7B's hyperparameters, and no
    tensors: a header as large as a real model's, for measuring header reads.

    llama.cpp's converter writes the hyperparameters before the tokenizer; ``tokenizer_first``
    writes them after it (the worst order for a reader that wants only the hyperparameters).
    """
    gguf, _ = _writer_modules()

    target = pathlib.Path(path)
    writer = gguf.GGUFWriter(target, "qwen2")

    def hparams() -> None:
        writer.add_block_count(28)
        writer.add_context_length(32768)
        writer.add_embedding_length(3584)
        writer.add_feed_forward_length(18944)
        writer.add_head_count(28)
        writer.add_head_count_kv(4)

    if not tokenizer_first:
        hparams()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i:x}" for i in range(n_tokens)])
    writer.add_token_types([1] * n_tokens)
    writer.add_token_merges([f"t{i:x} o{i % 977:x}" for i in range(n_merges)])
    if tokenizer_first:
        hparams()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _writer_modules() -> tuple[Any, Any]:
    """``gguf`` and ``numpy``, or the standard missing-extra error naming the ``llama`` extra."""
    try:
        import gguf
        import numpy as np
    except ImportError as e:
        from gpulock.core.errors import GpulockError
        from gpulock.core.extras import install_hint

        raise GpulockError(
            f"writing a GGUF model needs the llama extra ({e})", hint=install_hint("llama")
        ) from None
    return gguf, np


def _looks_complete(path: pathlib.Path) -> bool:
    """Whether ``path`` starts like a GGUF file and is big enough to hold the default weights."""
    try:
        with path.open("rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    return magic == _GGUF_MAGIC and size > _tensor_bytes(n_layer=2, n_embd=64, n_ff=128)


def ensure_tiny_llama(folder: str | os.PathLike[str]) -> pathlib.Path:
    """``<folder>/tiny-llama.gguf`` with the default sizes and seed, written if not there yet.

    A file already there is reused when it starts with the GGUF magic and is big enough to hold
    the weights; otherwise (a truncated or foreign file) it is written again.  Since writes are
    atomic, processes racing here at worst write the same bytes twice.
    """
    path = pathlib.Path(folder) / TINY_LLAMA_NAME
    if not _looks_complete(path):
        write_tiny_llama(path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: errors (a missing extra, an unwritable path) as ``error:``/``hint:``
    lines and exit 1, like every gpulock command, never a traceback."""
    from gpulock.cli import run_command

    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    from gpulock.cli import Parser
    from gpulock.core.errors import GpulockError

    parser = Parser(
        prog="python -m gpulock.router.tiny_model",
        description="Write a tiny random-weight llama GGUF model (for tests; output is nonsense).",
    )
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    args = parser.parse_args(argv)
    try:
        path = write_tiny_llama(args.out, seed=args.seed)
    except OSError as e:
        raise GpulockError(
            f"cannot write {args.out}: {e.strerror or e}",
            hint="give a path in a folder you can write",
        ) from None
    print(f"{path} {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
