"""``gpulock report``: one self-contained HTML page telling what a state folder's GPUs did.

Built from the event log alone (``<state>/events.jsonl`` and its rotated generation), in two
steps: ``build(events)`` turns events into data (pure: ``builder``, ``stats``, records in
``model``), ``render_html(data)`` turns that data into one HTML file with inline CSS, SVG and
script (``page``, ``timeline``, ``charts``, ``svg``).  ``summary``/``summary_lines`` give the
tables as JSON or plain lines; ``cli`` is the command (``main``) and ``write_report``.
"""

from __future__ import annotations

from gpulock.report.builder import build
from gpulock.report.cli import build_parser, main, since_wall_of, write_report
from gpulock.report.model import (
    AgentStats,
    GpuSeries,
    Hold,
    HolderStats,
    LevelSpan,
    Marker,
    ModelStats,
    Point,
    ReportData,
    Residency,
    Row,
    TierStats,
    Totals,
    Wait,
)
from gpulock.report.page import render_html
from gpulock.report.stats import percentile, steps
from gpulock.report.summaries import FORMAT, summary, summary_lines

__all__ = [
    "FORMAT",
    "AgentStats",
    "GpuSeries",
    "Hold",
    "HolderStats",
    "LevelSpan",
    "Marker",
    "ModelStats",
    "Point",
    "ReportData",
    "Residency",
    "Row",
    "TierStats",
    "Totals",
    "Wait",
    "build",
    "build_parser",
    "main",
    "percentile",
    "render_html",
    "since_wall_of",
    "steps",
    "summary",
    "summary_lines",
    "write_report",
]
