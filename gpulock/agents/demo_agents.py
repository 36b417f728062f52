"""The demo's fleet: twenty agents, as a house of small scheduled agents would have them.

Most are the example agents (``gpulock.agents.examples``) under their own names, each with its own
inputs: five digests, three inbox sorters, four taggers, three report drafters, two TTS batch
jobs, two indexers.  Two more show what gpulock is for:

- ``assistant`` keeps a chat model loaded on the GPU for the whole demo (``persistent``) and
  answers a question every few seconds; between questions it is idle, so the watchdog may evict
  it when the GPU fills up, and its next question reloads it.
- ``flaky-gpu`` takes the GPU and dies by SIGKILL while holding it, on every other run: the next
  agent in line gets the GPU within milliseconds, with no watchdog involved.

``make demo`` runs them with ``python -m gpulock.agents.demo``; they are also ordinary agents:
``gpulock agent run assistant --module gpulock.agents.demo_agents``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from gpulock.agents.examples.digest import digest
from gpulock.agents.examples.embed_index import embed_index
from gpulock.agents.examples.inbox_triage import inbox_triage
from gpulock.agents.examples.report_drafter import report_drafter
from gpulock.agents.examples.tagger import tagger
from gpulock.agents.examples.tts_batch import tts_batch
from gpulock.agents.runtime import Context
from gpulock.agents.spec import agent

# The demo is written for a 24 GiB GPU; on a real GPU of another size every declared size is
# scaled by gpulock/agents/demo.py through this variable, so the line forms the same way.
SCALE = float(os.environ.get("GPULOCK_DEMO_SCALE", "1"))


def gib(n: float) -> str:
    """``n`` GiB of the demo's 24 GiB GPU, scaled to the GPU in use (as MiB)."""
    return f"{max(1, int(n * 1024 * SCALE))}MiB"


# name -> (example function, task, need): what each demo agent is.
VARIANTS: dict[str, tuple[Callable[[Context], Any], str | None, str | None]] = {
    "digest-news": (digest, "summarize", None),
    "digest-notes": (digest, "summarize", None),
    "digest-meetings": (digest, "summarize", None),
    "digest-papers": (digest, "summarize", None),
    "digest-urgent": (digest, "summarize-fast", None),
    "triage-work": (inbox_triage, "classify", None),
    "triage-home": (inbox_triage, "classify", None),
    "triage-support": (inbox_triage, "classify", None),
    "tag-papers": (tagger, "tag", None),
    "tag-wiki": (tagger, "tag", None),
    "tag-photos": (tagger, "tag", None),
    "tag-mail": (tagger, "tag", None),
    "draft-weekly": (report_drafter, "draft", None),
    "draft-standup": (report_drafter, "draft", None),
    "draft-incident": (report_drafter, "draft", None),
    "tts-chapters": (tts_batch, "speech", gib(12)),
    "tts-podcast": (tts_batch, "speech", gib(8)),
    "index-wiki": (embed_index, None, None),
    "index-notes": (embed_index, None, None),
}

for _name, (_func, _task, _need) in VARIANTS.items():
    agent(
        _name,
        task=_task,
        need=_need,
        timeout="20s",
        description=f"demo: {(_func.__doc__ or _func.__name__).strip().splitlines()[0]}",
    )(_func)


QUESTIONS = (
    "What is on the calendar today?",
    "Summarise the last message from the team.",
    "Which GPU jobs ran overnight?",
    "Draft a two-line reply to the landlord.",
)


# The timeout bounds every wait until the run's deadline (start + timeout), not each wait: a
# long-lived agent needs one that covers its whole run, or its GPU calls past it cannot wait
# in line at all and fall back to the CPU.
@agent("assistant", task="chat", timeout="10m")
def assistant(ctx: Context) -> None:
    """demo: keep a chat model warm on the GPU and answer a question every few seconds."""
    seconds = float(os.environ.get("GPULOCK_DEMO_ASSISTANT_S", "40"))
    every = float(os.environ.get("GPULOCK_DEMO_ASSISTANT_EVERY_S", "6"))
    model = ctx.model()
    stop = time.monotonic() + seconds
    asked = 0
    while time.monotonic() < stop:
        question = QUESTIONS[asked % len(QUESTIONS)]
        answer = model.chat([{"role": "user", "content": question}], max_tokens=16)
        asked += 1
        ctx.log.info("answered", extra={"question": question, "chars": len(answer)})
        # Idle between questions: the watchdog may evict the model meanwhile; the next question
        # then reloads it (the router's resident has a load= callable).
        threading.Event().wait(min(every, max(0.0, stop - time.monotonic())))
    ctx.log.info("done", extra={"questions": asked, "tier": model.tier})


@agent("flaky-gpu", need=gib(4), timeout="20s")
def flaky_gpu(ctx: Context) -> None:
    """demo: a GPU job that crashes (SIGKILL) while holding the GPU, every other run."""
    marker = ctx.agent_dir / "crashed-last-time"
    with ctx.gpu():
        if not marker.exists():
            marker.touch()
            ctx.log.warning("about to die by SIGKILL while holding the GPU")
            os.kill(os.getpid(), signal.SIGKILL)
        marker.unlink()
        threading.Event().wait(0.5)  # a short, well-behaved hold this time


# Where each agent's inputs live under the demo's work folder (see gpulock/agents/demo.py).
INPUTS: dict[str, str] = {
    "digest-news": "notes",
    "digest-notes": "notes",
    "digest-meetings": "report-notes",
    "digest-papers": "report-notes",
    "digest-urgent": "notes",
    "triage-work": "inbox",
    "triage-home": "inbox",
    "triage-support": "inbox",
    "tag-papers": "notes",
    "tag-wiki": "report-notes",
    "tag-photos": "inbox",
    "tag-mail": "inbox",
    "draft-weekly": "report-notes",
    "draft-standup": "notes",
    "draft-incident": "report-notes",
    "tts-chapters": "speech",
    "tts-podcast": "speech",
    "index-wiki": "notes",
    "index-notes": "report-notes",
}
