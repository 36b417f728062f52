"""Cron-safe agents: declare one with ``@agent``, run it with ``gpulock agent run NAME``.

::

    from gpulock.agents import Context, agent

    @agent("digest", task="summarize", schedule="*/10 * * * *", timeout="10m", need="6GiB")
    def digest(ctx: Context) -> None:
        model = ctx.model()  # the router's pick for "summarize", within the timeout
        for path in ctx.batch(sorted(ctx.inputs[0].glob("*.txt")), key=str):
            ...  # checkpointed: a killed run resumes here

The runtime (``gpulock.agents.runtime``) runs one instance at a time, turns a GPU or model that
cannot be had in time into a logged skip (exit 75), keeps a JSON log per agent and an ``agent``
event per run.  Importing this package stays light: no router, apscheduler, llama_cpp, openai or
torch.
"""

from __future__ import annotations

from gpulock.agents.runtime import Context, Stopped, run_agent
from gpulock.agents.spec import AgentError, AgentSpec, agent, get, registered

__all__ = [
    "AgentError",
    "AgentSpec",
    "Context",
    "Stopped",
    "agent",
    "get",
    "registered",
    "run_agent",
]
