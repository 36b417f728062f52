"""router: ``router.get_model("summarize")`` picks a local CPU, local GPU or cloud model for a task,
for this machine at this moment.

::

    from gpulock import router

    model = router.get_model("summarize", deadline=60)
    print(model.tier, model.name)       # "gpu", "qwen2.5-7b-instruct-q4_k_m"
    print(model.why)                    # what was chosen, and why not each other candidate
    text = model.complete("Summarise: ...", max_tokens=200)

Agents never name a model: the route table in the config (``routes:``) lists each task's
candidates, best first, and the same agent runs on a 6 GB laptop and a 96 GB workstation.
Importing this package is light: llama_cpp and openai load with the first model that needs them.
"""

from __future__ import annotations

from gpulock.router.errors import NoModelAvailable, UnknownPreference, UnknownTask
from gpulock.router.model import Model
from gpulock.router.select import explain, get_model

__all__ = [
    "Model",
    "NoModelAvailable",
    "UnknownPreference",
    "UnknownTask",
    "explain",
    "get_model",
]
