"""The example agents: real file work, every model call through the router.

Importing this package registers them (``python -m gpulock.agents run`` imports it on its own)::

    digest           summarize  notes folder -> one Markdown digest, a summary per note
    inbox-triage     classify   inbox folder -> <out>/<label>/ copies + triage.jsonl
    tagger           tag        documents -> <doc>.tags.json sidecars + tags.json
    report-drafter   draft      notes folder -> Markdown report (outline by chat, streamed sections)
    tts-batch        -          lines of text -> WAV files, chunk by chunk under the GPU lock
    embed-index      -          documents -> bag-of-words index (JSON), CPU only

Run one with ``gpulock agent run NAME INPUT... [--out PATH]``; without ``--out`` the result goes
to ``<state>/agents/NAME/out/``.  Sample inputs are in ``examples/data/`` of the source tree and
a sample config with routes for these tasks in ``examples/gpulock.yaml``.  Importing this stays
light: the router (and llama.cpp) is imported by the first ``ctx.model()``.
"""

from __future__ import annotations

from gpulock.agents.examples import (
    digest,
    embed_index,
    inbox_triage,
    report_drafter,
    tagger,
    tts_batch,
)

__all__ = ["digest", "embed_index", "inbox_triage", "report_drafter", "tagger", "tts_batch"]
