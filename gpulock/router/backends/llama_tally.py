"""A llama.cpp call's tokens, counted as it processes them (``tallied``), for a stream too.

llama-cpp-python counts the prompt and the output only for an unstreamed call; a stream's chunks
are not tokens.  So the one call is watched where both kinds run through: ``Llama.generate``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any


@contextlib.contextmanager
def tallied(llm: Any, usage: dict[str, int]) -> Iterator[None]:
    """Count one call's tokens into ``usage`` (``tokens_in``, ``tokens_out``) as llama.cpp
    processes them.

    A stream's chunks are not tokens (a multi-byte character or a possible stop sequence is
    held back and sent with the next ones), and the prompt the model reads is the chat
    template's, not the messages' text: llama-cpp-python counts both only for an unstreamed
    call.  Both kinds of call run through ``Llama.generate(prompt_tokens)``, which yields each
    token it samples; the completion loop keeps every one but an end-of-generation token.
    So the generator is wrapped for this call (the backend's lock keeps calls one at a time):
    the prompt is what it is given, the output what it yields less the end token.
    """
    usage["tokens_in"] = usage["tokens_out"] = 0
    inner = llm.generate  # the bound method (an instance attribute shadows it for this call)
    eog = _eog_test(llm)

    def generate(tokens: Sequence[int], *args: Any, **kw: Any) -> Iterator[int]:
        usage["tokens_in"] = len(tokens)
        for token in inner(tokens, *args, **kw):
            if not eog(token):
                usage["tokens_out"] += 1
            yield token

    llm.generate = generate
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del llm.generate


def _eog_test(llm: Any) -> Callable[[int], bool]:
    """Whether a token ends generation (end of sequence, end of turn), as llama.cpp decides."""
    try:
        import llama_cpp

        vocab = llm._model.vocab
        test = llama_cpp.llama_vocab_is_eog
        return lambda t: bool(test(vocab, t))
    except (ImportError, AttributeError):
        eos = llm.token_eos()
        return lambda t: t == eos
