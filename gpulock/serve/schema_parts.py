"""The small pieces every API's request schema is built from (``gpulock.serve.schema``): a
number, an optional OpenAI parameter, a model name.

A property may carry ``x-message``, the sentence a client reads when that property is wrong
(``gpulock.serve.validator``); ``opt`` keeps it on the wrapper, where the validator looks first.
"""

from __future__ import annotations

from typing import Final

from gpulock.serve.validator import Schema

NUM: Final[Schema] = {"type": "number"}


def opt(schema: Schema) -> Schema:
    """An optional OpenAI parameter: JSON ``null`` means "not given", as the clients send it."""
    return {
        "anyOf": [schema, {"type": "null"}],
        **{k: v for k, v in schema.items() if k[:2] == "x-"},
    }


def model_name(message: str) -> Schema:
    """The ``model`` property: a task or model name, ``message`` when it is missing or empty."""
    return {"type": "string", "minLength": 1, "x-message": message}
