"""``render_html(data)``: the whole page as one string, with nothing to fetch.

Inline CSS, inline SVG (``timeline``, ``charts``) and a few lines of inline JavaScript (sortable
tables): no network, no external file, so the page can be mailed or opened from a cron box's
disk.  Every text that came from the log is HTML-escaped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpulock.core.units import format_duration
from gpulock.report.charts import gpu_charts
from gpulock.report.model import ReportData
from gpulock.report.svg import Scale, esc
from gpulock.report.timeline import LEGEND, timeline
from gpulock.report.values import clock


def _cell(attr: str, v: Any) -> str:
    """One table cell: numbers right-aligned, with the raw value to sort by."""
    if isinstance(v, str):
        return f"<td>{esc(v)}</td>"
    if attr.endswith("_s"):
        text, key = ("—", -1.0) if v is None else (format_duration(v), v)
    elif attr.endswith("_usd"):
        text, key = f"${v:,.4f}", v
    else:
        text, key = f"{v:,}", v
    return f'<td class="n" data-v="{key:.9g}">{esc(text)}</td>'


def _table(items: Sequence[Any], cols: Sequence[tuple[str, str]], none: str) -> str:
    """A sortable table of ``items`` (dataclasses); ``cols``: (header, attribute) pairs."""
    if not items:
        return f'<p class="none">{esc(none)}</p>'
    head = "".join(
        f"<th>{esc(h)}</th>"
        if isinstance(getattr(items[0], a), str)
        else f'<th class="n">{esc(h)}</th>'
        for h, a in cols
    )
    body = "".join(
        "<tr>" + "".join(_cell(a, getattr(x, a)) for _, a in cols) + "</tr>" for x in items
    )
    return f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


@dataclass(frozen=True, slots=True)
class _Kind:
    event: str
    count: int


_HOLDER_COLS = (
    ("holder", "name"), ("runs", "runs"), ("wait p50", "waits_p50_s"),
    ("wait p99", "waits_p99_s"), ("timeouts", "timeouts"), ("held", "held_s"),
    ("cut short", "cut_short"),
)  # fmt: skip
_AGENT_COLS = (
    ("agent", "agent"), ("runs", "runs"), ("ok", "ok"), ("skip", "skip"), ("error", "error"),
    ("other", "other"), ("duration p50", "duration_p50_s"),
    ("last skip/error", "last_reason"),
)  # fmt: skip
_TIER_COLS = (
    ("tier", "tier"), ("route choices", "routes"), ("calls", "calls"), ("failed", "failed"),
    ("tokens in", "tokens_in"), ("tokens out", "tokens_out"), ("cost", "cost_usd"),
    ("latency p50", "latency_p50_s"),
)  # fmt: skip
_MODEL_COLS = (
    ("model", "model"), ("tier", "tier"), ("calls", "calls"), ("failed", "failed"),
    ("tokens in", "tokens_in"),
    ("tokens out", "tokens_out"), ("cost", "cost_usd"), ("latency p50", "latency_p50_s"),
    ("latency p99", "latency_p99_s"),
)  # fmt: skip


def _tables(data: ReportData) -> str:
    kinds = [_Kind(k, n) for k, n in data.kinds]
    return "".join(
        [
            "<h2>Holders</h2>",
            _table(data.holders, _HOLDER_COLS, "no GPU holders in this window"),
            "<h2>Agent runs</h2>",
            _table(data.agents, _AGENT_COLS, "no agent events in this log"),
            "<h2>Route choices and model calls</h2>",
            _table(data.tiers, _TIER_COLS, "no route or call events in this log"),
            _table(data.models, _MODEL_COLS, "") if data.models else "",
            "<h2>Events</h2>",
            _table(kinds, (("event", "event"), ("count", "count")), "no events"),
        ]
    )


def _cards(data: ReportData) -> str:
    t = data.totals
    cards = [
        ("GPU handoffs", f"{t.handoffs:,}"),
        ("waits p50 / p99", f"{format_duration(t.waits_p50_s)} / {format_duration(t.waits_p99_s)}"),
        ("timeouts", f"{t.timeouts:,}"),
        ("cut short", f"{t.cut_short:,}"),
        ("evictions", f"{t.evictions:,}"),
        (
            "level changes",
            f"{t.level_changes:,}" + (f" (now {t.level_now})" if t.level_now else ""),
        ),
    ]
    if t.agent_runs:
        cards.append(
            ("agent runs", f"{t.agent_runs:,} ({t.agent_skips} skip, {t.agent_errors} err)")
        )
    if t.route_choices or t.calls:
        cards.append(("routes / calls", f"{t.route_choices:,} / {t.calls:,}"))
    if t.cost_usd:
        cards.append(("cost", f"${t.cost_usd:,.4f}"))
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v">{esc(v)}</div><div class="k">{esc(k)}</div></div>'
            for k, v in cards
        )
        + "</div>"
    )


_CSS = """
:root{--fg:#1d2330;--mute:#667085;--line:#e4e7ec;--bg:#fff}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);
background:#f6f7f9}
main{max-width:1260px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:22px;margin:0 0 2px}h2{font-size:17px;margin:28px 0 8px}
h3{font-size:13px;margin:14px 0 2px;color:var(--mute);font-weight:600}
.sub{color:var(--mute);margin:0 0 14px}.none{color:var(--mute);font-style:italic}
section{background:var(--bg);border:1px solid var(--line);border-radius:10px;padding:6px 16px 14px;
margin-top:16px}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{background:var(--bg);border:1px solid var(--line);border-radius:10px;padding:10px 14px;
min-width:140px}
.card .v{font-size:18px;font-weight:650}.card .k{color:var(--mute);font-size:12px}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12px;color:var(--mute);margin:4px 0 8px}
.legend span{display:inline-flex;align-items:center;gap:6px}
svg text{font-size:11px;fill:#344054}svg .tick{fill:var(--mute);font-size:10px}
.row-label.resident{fill:#7a4f73}.row-label.governor{fill:#8a5a00;font-weight:600}
.grid{stroke:#eef0f3;stroke-width:1}.gpu-sep{stroke:#c9ced6;stroke-width:1}
.stripe{fill:#f8f9fb}
.hold{stroke:#0000;}.hold.cut{stroke:#c0392b;stroke-width:1}.hold.merged{opacity:.85}
.cut-end{stroke:#c0392b;stroke-width:2}
.wait{fill-opacity:.25}
.resident{fill:#b07aa1;fill-opacity:.6}
.mark{stroke-width:1.6;fill:#fff}
.mark.timeout,.mark.governor-error{stroke:#d92d20;fill:none;stroke-width:2.2}
.mark.kill{fill:#d92d20;stroke:#7a1a12}.mark.evict{fill:#7f56d9;stroke:#42307d}
.mark.cleanup,.mark.break{fill:#fdb022;stroke:#93370d}.mark.stale{fill:#fff;stroke:#dc6803}
.mark.oom{fill:#d92d20;stroke:#7a1a12}.mark.escalate{fill:#dc6803;stroke:#93370d}
.mark.deescalate{fill:#12b76a;stroke:#05603a}.mark.other,.mark.unload{fill:#98a2b3;stroke:#475467}
.level{opacity:.55}.lv-reduce{fill:#fef0c7}.lv-evict-idle{fill:#fedf89}
.lv-force-evict{fill:#fecdca}.lv-freeze{fill:#d9d6fe}.lv-other{fill:#eaecf0}
.fz{background:#d9d6fe;padding:0 3px;border-radius:3px}
.series{fill:none;stroke-width:1.8}.band{fill:#98a2b3;fill-opacity:.18}
table{border-collapse:collapse;width:100%;font-size:13px;margin:6px 0 4px}
th,td{padding:5px 10px;border-bottom:1px solid var(--line);text-align:left;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums}
th{cursor:pointer;user-select:none;color:var(--mute);font-weight:600;background:#fafbfc}
th.n{text-align:right}th[data-dir=asc]::after{content:" ▲"}th[data-dir=desc]::after{content:" ▼"}
footer{color:var(--mute);font-size:12px;margin-top:18px}
"""

# Sortable tables: click a header; numeric cells sort by their data-v.  The attribute set at
# the end tells a reader of the rendered page (and the render test) that the script ran.
_JS = """
(function(){
function key(td){var v=td.getAttribute("data-v");return v===null?td.textContent:parseFloat(v);}
document.querySelectorAll("table.sortable").forEach(function(t){
 t.querySelectorAll("th").forEach(function(th,i){th.addEventListener("click",function(){
  var asc=th.getAttribute("data-dir")!=="asc";
  t.querySelectorAll("th").forEach(function(o){o.removeAttribute("data-dir");});
  th.setAttribute("data-dir",asc?"asc":"desc");
  var b=t.tBodies[0],rows=Array.prototype.slice.call(b.rows);
  rows.sort(function(a,c){var x=key(a.cells[i]),y=key(c.cells[i]);
   return (x<y?-1:x>y?1:0)*(asc?1:-1);});
  rows.forEach(function(r){b.appendChild(r);});});});});
document.documentElement.setAttribute("data-js","ready");
})();
"""


def render_html(
    data: ReportData, *, source: str | None = None, generated_wall: float | None = None
) -> str:
    """The page, one string: inline CSS, SVG and script; every text from the log escaped."""
    where = f"state folder {source} · " if source else ""
    head = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>gpulock report{' · ' + esc(source) if source else ''}</title>"
        f"<style>{_CSS}</style></head><body><main><h1>gpulock report</h1>"
    )
    generated = f" · generated {clock(generated_wall)}" if generated_wall is not None else ""
    if data.start_wall is None or data.end_wall is None:
        since = f" since {clock(data.since_wall)}" if data.since_wall is not None else ""
        return (
            f'{head}<p class="sub">{esc(where)}{esc(generated.lstrip(" ·"))}</p>'
            f'<section><p class="none empty">The event log is empty: no events{esc(since)}.'
            "</p></section></main></body></html>"
        )
    span = format_duration(data.end_wall - data.start_wall)
    tz = clock(data.start_wall, "%Z")
    sub = (
        f"{where}{clock(data.start_wall)} → {clock(data.end_wall)} {tz} ({span}) · "
        f"{data.events:,} events"
        + (f", {data.ignored:,} unreadable records skipped" if data.ignored else "")
        + generated
    )
    scale = Scale(data.start_wall, data.end_wall)
    queue, vram = gpu_charts(data, scale)
    return "".join(
        [
            head,
            f'<p class="sub">{esc(sub)}</p>',
            _cards(data),
            "<section><h2>Timeline</h2>",
            LEGEND,
            timeline(data, scale),
            "</section><section><h2>Queue length</h2>",
            queue,
            "</section><section><h2>VRAM</h2>",
            vram,
            "</section><section>",
            _tables(data),
            "</section><footer>Times are local. VRAM claimed counts declared sizes (a "
            "holder's --need, a resident model's declared bytes); a model unloaded by its "
            "owner leaves no event, so its bar runs until an eviction, a cleanup or the end of "
            "the log. Hover a bar or a marker for details; click a table header to sort."
            "</footer></main>",
            f"<script>{_JS}</script></body></html>",
        ]
    )
