"""The request shapes of ``gpulock serve``'s endpoints, as JSON Schema.

The same dictionaries are the request bodies of ``GET /openapi.json`` (``gpulock.serve.openapi``)
and what ``gpulock.serve.validator`` checks every body against before a handler reads it, so the
published document and what the handlers accept cannot drift apart.  A property may carry
``x-message``, the sentence a client reads when that property is wrong; unknown properties are
allowed: the official clients send more than gpulock uses.

Each API's shapes live in a module of their own (``schema_openai``, ``schema_responses``,
``schema_anthropic``, ``schema_ollama``, built from ``schema_parts``); this module is the one
place the app, the OpenAPI document and the tests name them by.
"""

from __future__ import annotations

from gpulock.serve.schema_anthropic import ANTHROPIC_MESSAGES
from gpulock.serve.schema_ollama import (
    OLLAMA_CHAT,
    OLLAMA_EMBED,
    OLLAMA_EMBEDDINGS,
    OLLAMA_GENERATE,
    OLLAMA_SHOW,
)
from gpulock.serve.schema_openai import OPENAI_CHAT, OPENAI_COMPLETION, OPENAI_EMBEDDINGS
from gpulock.serve.schema_responses import RESPONSES

__all__ = [
    "ANTHROPIC_MESSAGES",
    "OLLAMA_CHAT",
    "OLLAMA_EMBED",
    "OLLAMA_EMBEDDINGS",
    "OLLAMA_GENERATE",
    "OLLAMA_SHOW",
    "OPENAI_CHAT",
    "OPENAI_COMPLETION",
    "OPENAI_EMBEDDINGS",
    "RESPONSES",
]
