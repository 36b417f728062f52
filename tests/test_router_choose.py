"""gpulock.router.choose: the pure decision, table-tested with hand-built Hosts, GPUs and
candidates.

No file, clock, GPU or environment is read here: each row is a machine state and the verdict it
must give, reason text included (the reasons are what ``.why`` and ``gpulock route`` show).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpulock.router.choose import Choice, GpuView, Host, choose, cid
from gpulock.router.routes import Candidate

GiB = 1024**3
NOW = 1_800_000_000.0


def cand(key: str = "routes.t[0]", **kw: Any) -> Candidate:
    fields: dict[str, Any] = {
        "task": "t",
        "key": key,
        "tier": "gpu",
        "backend": "llama_cpp",
        "model": f"/models/{key}.gguf",
        "name": key,
        "n_ctx": 4096,
        "n_gpu_layers": -1,
        "n_batch": 512,
        "n_threads": None,
        "vram_bytes": 4 * GiB,
        "min_vram_bytes": None,
        "price_in_per_1k": 0.0,
        "price_out_per_1k": 0.0,
        "daily_budget_usd": None,
        "rate_limit_per_min": None,
        "base_url": None,
        "api_key_env": None,
        "policy": "persistent",
        "timeout_s": 60.0,
        "gpu": None,
        "max_tokens": 64,
    }
    fields.update(kw)
    if fields["tier"] == "cloud":
        fields.setdefault("backend", "openai")
        fields["backend"] = "openai"
        fields["base_url"] = fields["base_url"] or "https://api.example/v1"
        fields["api_key_env"] = fields["api_key_env"] or "KEY"
        fields["model"] = kw.get("model", "gpt-small")
        fields["vram_bytes"] = None
    if fields["tier"] == "cpu":
        fields["n_gpu_layers"] = 0
    return Candidate(**fields)


def gpu(total_gib: float, *, free_gib: float | None = None, index: int = 0, **kw: Any) -> GpuView:
    total = int(total_gib * GiB)
    budget = int(total * 0.9)
    free = budget if free_gib is None else int(free_gib * GiB)
    return GpuView(index, total, budget, free, **kw)


def host(*gpus: GpuView, **kw: Any) -> Host:
    return Host(gpus=gpus, now_wall=NOW, env=frozenset({"KEY"}), **kw)


BIG_GPU = cand("routes.t[0]", name="qwen-7b", vram_bytes=8 * GiB)
SMALL_GPU = cand("routes.t[1]", name="qwen-1.5b", vram_bytes=2 * GiB)
CPU = cand("routes.t[2]", tier="cpu", name="qwen-0.5b", vram_bytes=None)
CLOUD = cand("routes.t[3]", tier="cloud", name="gpt-small")
ALL = (BIG_GPU, SMALL_GPU, CPU, CLOUD)


def reasons(choice: Choice) -> dict[str, str]:
    return {v.candidate.name: v.reason for v in choice.verdicts}


def chosen(choice: Choice) -> str | None:
    return choice.chosen.candidate.name if choice.chosen else None


# --- the machine: GPUs and their memory -------------------------------------------------------


def test_no_gpu_skips_gpu_candidates_with_the_probe_problem() -> None:
    c = choose("t", ALL, host(gpu_problem="NVML not available (no driver)"))
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["qwen-7b"] == "no GPU: NVML not available (no driver)"
    assert reasons(c)["qwen-1.5b"] == "no GPU: NVML not available (no driver)"
    assert c.chosen is not None and c.chosen.gpu is None


def test_small_gpu_rejects_the_big_model_with_the_numbers() -> None:
    c = choose("t", ALL, host(gpu(6)))  # 6 GiB, 10 % reserve: 5.4 GiB to hand out
    assert chosen(c) == "qwen-1.5b"
    assert reasons(c)["qwen-7b"] == (
        "too little VRAM: needs 8.0 GiB, gpu0 has 5.4 GiB (after the reserve)"
    )
    assert c.chosen is not None and c.chosen.need_bytes == 2 * GiB and c.chosen.gpu == 0


def test_big_gpu_takes_the_first_candidate() -> None:
    c = choose("t", ALL, host(gpu(24)))
    assert chosen(c) == "qwen-7b"
    assert reasons(c)["qwen-7b"] == "gpu0: needs 8.0 GiB"
    assert [v.ok for v in c.verdicts] == [True, True, True, True]
    assert "passed over: gpu qwen-1.5b" in c.explain()


def test_min_vram_is_about_the_gpu_size_not_its_free_memory() -> None:
    picky = replace(SMALL_GPU, min_vram_bytes=12 * GiB)
    c = choose("t", (picky, CPU), host(gpu(8)))
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["qwen-1.5b"] == "needs a GPU of 12.0 GiB, gpu0 has 8.0 GiB"


def test_the_gpu_with_room_now_wins_over_one_that_must_wait() -> None:
    busy = gpu(24, index=0, free_gib=1)
    idle = gpu(24, index=1, free_gib=20)
    c = choose("t", (BIG_GPU,), host(busy, idle))
    assert c.chosen is not None and c.chosen.gpu == 1


def test_a_pinned_gpu_index_that_does_not_exist() -> None:
    c = choose("t", (replace(SMALL_GPU, gpu=3), CPU), host(gpu(24)))
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["qwen-1.5b"] == "no gpu3 on this machine (routes.t[1].gpu)"


def test_unknown_vram_estimate_asks_for_the_whole_gpu() -> None:
    c = choose("t", (replace(SMALL_GPU, vram_bytes=None),), host(gpu(24)))
    assert c.chosen is not None and c.chosen.need_bytes is None
    assert c.chosen.reason == "gpu0: needs the whole GPU"


def test_vram_of_is_the_hosts_estimator() -> None:
    sized = host(gpu(8), vram_of=lambda c: 15 * GiB // 2 if c.name == "qwen-1.5b" else c.vram_bytes)
    c = choose("t", (SMALL_GPU, CPU), sized)
    assert chosen(c) == "qwen-0.5b"
    assert "needs 7.5 GiB" in reasons(c)["qwen-1.5b"]


# --- the governor -----------------------------------------------------------------------------


def test_reduce_halves_context_and_batch_and_says_so() -> None:
    c = choose("t", ALL, host(gpu(24), level="reduce"))
    assert c.level == "reduce"
    got = c.candidate
    assert got is not None and got.name == "qwen-7b"
    assert (got.n_ctx, got.n_batch) == (2048, 256)
    assert reasons(c)["qwen-7b"] == "gpu0: needs 8.0 GiB; governor level reduce: n_ctx 4096 -> 2048"
    assert BIG_GPU.n_ctx == 4096  # the table itself is untouched


@pytest.mark.parametrize("level", ["evict-idle", "force-evict"])
def test_the_levels_above_reduce_reduce_too(level: str) -> None:
    # The governor's ladder: each level includes the actions of the levels below it.
    c = choose("t", ALL, host(gpu(24), level=level))
    assert c.candidate is not None and c.candidate.n_ctx == 2048
    assert f"governor level {level}: n_ctx 4096 -> 2048" in reasons(c)["qwen-7b"]


def test_reduce_never_goes_below_the_floor_and_keeps_small_contexts() -> None:
    tiny = replace(SMALL_GPU, n_ctx=256, n_batch=16)
    c = choose("t", (tiny,), host(gpu(24), level="reduce"))
    assert c.candidate is not None and (c.candidate.n_ctx, c.candidate.n_batch) == (256, 16)
    assert "governor" not in reasons(c)["qwen-1.5b"]
    mid = replace(SMALL_GPU, n_ctx=768)
    c = choose("t", (mid,), host(gpu(24), level="reduce"))
    assert c.candidate is not None and c.candidate.n_ctx == 512


def test_reduce_shrinks_the_estimate_the_lock_will_ask_for() -> None:
    by_ctx = host(gpu(24), level="reduce", vram_of=lambda c: c.n_ctx * 1024 * 1024)
    c = choose("t", (SMALL_GPU,), by_ctx)
    assert c.chosen is not None and c.chosen.need_bytes == 2048 * 1024 * 1024


def test_freeze_skips_gpu_candidates_and_the_cpu_serves() -> None:
    c = choose("t", ALL, host(gpu(24), level="freeze"))
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["qwen-7b"] == "governor level freeze: new GPU work waits"
    assert reasons(c)["qwen-1.5b"] == "governor level freeze: new GPU work waits"


# --- the queue against the deadline -----------------------------------------------------------


def test_a_queue_longer_than_the_deadline_passes_the_gpu_over() -> None:
    queued = gpu(24, ahead=3, est_wait_s=90.0)
    c = choose("t", ALL, host(queued), deadline_s=30)
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["qwen-7b"] == "gpu0 queue: ~1m30s wait (3 ahead) > deadline 30.0 s"


def test_a_queue_within_the_deadline_is_waited_for() -> None:
    queued = gpu(24, ahead=2, est_wait_s=20.0)
    c = choose("t", ALL, host(queued), deadline_s=30)
    assert chosen(c) == "qwen-7b"
    assert reasons(c)["qwen-7b"] == "gpu0: needs 8.0 GiB, ~20.0 s queue wait"


def test_no_deadline_waits_for_any_queue_and_an_unknown_wait_is_not_a_reason() -> None:
    assert chosen(choose("t", ALL, host(gpu(24, ahead=9, est_wait_s=3600.0)))) == "qwen-7b"
    unknown = gpu(24, ahead=9, est_wait_s=None)
    assert chosen(choose("t", ALL, host(unknown), deadline_s=1)) == "qwen-7b"


def test_holders_that_leave_room_are_shared_with_not_waited_for() -> None:
    # gpulock grants a need at once next to holders whose needs leave room in the budget
    # (21.6 GiB here): that is no queue, whatever the typical hold time says.
    room = gpu(24, ahead=2, est_wait_s=90.0, shared_bytes=6 * GiB)
    c = choose("t", ALL, host(room), deadline_s=30)
    assert chosen(c) == "qwen-7b"
    assert reasons(c)["qwen-7b"] == "gpu0: needs 8.0 GiB, shared with 2 holders"
    full = gpu(24, ahead=2, est_wait_s=90.0, shared_bytes=16 * GiB)  # 16 + 8 > 21.6
    c = choose("t", ALL, host(full), deadline_s=30)
    assert reasons(c)["qwen-7b"] == "gpu0 queue: ~1m30s wait (2 ahead) > deadline 30.0 s"
    assert chosen(c) == "qwen-1.5b"  # 16 + 2 fits: it shares
    assert reasons(c)["qwen-1.5b"] == "gpu0: needs 2.0 GiB, shared with 2 holders"
    # no estimate: the lock would ask for the whole GPU, which never shares
    unsized = replace(BIG_GPU, vram_bytes=None)
    c = choose("t", (unsized, CPU), host(room), deadline_s=30)
    assert chosen(c) == "qwen-0.5b"


def test_the_shorter_queue_wins_among_gpus() -> None:
    long_q = gpu(24, index=0, ahead=4, est_wait_s=120.0)
    short_q = gpu(24, index=1, ahead=1, est_wait_s=10.0)
    c = choose("t", (BIG_GPU,), host(long_q, short_q), deadline_s=60)
    assert c.chosen is not None and c.chosen.gpu == 1


# --- the cloud: keys, budgets, rate limits, cooldowns ------------------------------------------


def test_budget_spent_for_one_candidate() -> None:
    capped = replace(CLOUD, daily_budget_usd=1.0)
    spent = host(spend_today_usd={cid(capped): 1.25})
    c = choose("t", (capped, CPU), spent)
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["gpt-small"] == "daily budget spent: $1.2500 of $1.00 today"
    # a budget under a cent is shown as written, not rounded to "$0.01"
    tiny = replace(CLOUD, daily_budget_usd=0.005)
    c = choose("t", (tiny, CPU), host(spend_today_usd={cid(tiny): 0.03}))
    assert reasons(c)["gpt-small"] == "daily budget spent: $0.0300 of $0.005 today"
    c = choose("t", (CLOUD,), host(spend_today_usd={cid(CLOUD): 1}, daily_budget_usd=0.0125))
    assert reasons(c)["gpt-small"] == (
        "cloud budget spent: $1.0000 of $0.0125 today (router.daily_budget)"
    )


def test_router_daily_budget_counts_every_cloud_candidate() -> None:
    other = cand("routes.t[4]", tier="cloud", model="gpt-big", name="gpt-big")
    spent = host(spend_today_usd={cid(other): 3.0, cid(CLOUD): 2.5}, daily_budget_usd=5.0)
    c = choose("t", (CLOUD,), spent)
    assert chosen(c) is None
    assert reasons(c)["gpt-small"] == (
        "cloud budget spent: $5.5000 of $5.00 today (router.daily_budget)"
    )
    under = host(spend_today_usd={cid(other): 3.0}, daily_budget_usd=5.0)
    assert chosen(choose("t", (CLOUD,), under)) == "gpt-small"


def test_rate_limit_counts_the_last_minute() -> None:
    limited = replace(CLOUD, rate_limit_per_min=10)
    c = choose("t", (limited, CPU), host(requests_last_min={cid(limited): 10}))
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["gpt-small"] == "rate limit: 10 requests in the last minute (of 10)"
    assert chosen(choose("t", (limited,), host(requests_last_min={cid(limited): 9}))) == (
        "gpt-small"
    )


def test_cooldown_rejects_until_it_ends() -> None:
    cooling = host(cooldown_until={cid(CLOUD): (NOW + 90, "rate-limit (HTTP 429)")})
    c = choose("t", (CLOUD, CPU), cooling)
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["gpt-small"] == (
        "cooling down after errors for 1m30s more (last: rate-limit (HTTP 429))"
    )
    ended = host(cooldown_until={cid(CLOUD): (NOW - 1, "server (HTTP 500)")})
    assert chosen(choose("t", (CLOUD, CPU), ended)) == "gpt-small"


def test_cooldown_applies_to_local_models_too() -> None:
    cooling = host(gpu(24), cooldown_until={cid(BIG_GPU): (NOW + 5, "load")})
    c = choose("t", ALL, cooling)
    assert chosen(c) == "qwen-1.5b"
    assert reasons(c)["qwen-7b"].startswith("cooling down after errors for 5.0 s more (last: load)")


def test_missing_api_key_variable_names_the_key() -> None:
    no_key = Host(now_wall=NOW, env=frozenset())
    c = choose("t", (CLOUD,), no_key)
    assert chosen(c) is None
    assert reasons(c)["gpt-small"] == (
        "environment variable KEY is not set (routes.t[3].api_key_env)"
    )


def test_missing_model_file_names_the_key() -> None:
    gone = host(gpu(24), missing_files=frozenset({BIG_GPU.model}))
    c = choose("t", ALL, gone)
    assert chosen(c) == "qwen-1.5b"
    assert reasons(c)["qwen-7b"] == (f"model file not found: {BIG_GPU.model} (routes.t[0].model)")


def test_cloud_reason_shows_todays_spend() -> None:
    c = choose("t", (CLOUD,), host(spend_today_usd={cid(CLOUD): 0.125}))
    assert reasons(c)["gpt-small"] == "cloud, $0.1250 spent today"


# --- preferences --------------------------------------------------------------------------------


def test_a_warm_model_beats_a_cold_one_of_the_same_tier() -> None:
    c = choose("t", ALL, host(gpu(24), warm=frozenset({cid(SMALL_GPU)})))
    assert chosen(c) == "qwen-1.5b"
    assert c.chosen is not None and c.chosen.warm
    assert reasons(c)["qwen-1.5b"] == "gpu0: needs 2.0 GiB (warm)"
    assert reasons(c)["qwen-7b"] == "gpu0: needs 8.0 GiB; passed over for warm qwen-1.5b"


def test_a_warm_model_of_another_tier_does_not_jump_the_order() -> None:
    c = choose("t", ALL, host(gpu(24), warm=frozenset({cid(CPU)})))
    assert chosen(c) == "qwen-7b"
    assert reasons(c)["qwen-0.5b"] == "runs on the CPU (warm)"


def test_warm_on_the_cpu_is_not_warm_on_the_gpu() -> None:
    same_file_cpu = replace(CPU, model=BIG_GPU.model)
    assert cid(same_file_cpu) != cid(BIG_GPU)


@pytest.mark.parametrize(
    ("prefer", "expected"),
    [("cpu", "qwen-0.5b"), ("cloud", "gpt-small"), ("qwen-1.5b", "qwen-1.5b"), ("gpu", "qwen-7b")],
)
def test_prefer_a_tier_or_a_name(prefer: str, expected: str) -> None:
    assert chosen(choose("t", ALL, host(gpu(24)), prefer=prefer)) == expected


def test_prefer_falls_back_when_the_preferred_one_does_not_fit() -> None:
    c = choose("t", ALL, host(gpu(24), level="freeze"), prefer="gpu")
    assert chosen(c) == "qwen-0.5b"


def test_excluded_candidates_say_what_failed() -> None:
    c = choose("t", (CLOUD, CPU), host(), exclude={cid(CLOUD): "server (HTTP 500)"})
    assert chosen(c) == "qwen-0.5b"
    assert reasons(c)["gpt-small"] == "failed on this call already: server (HTTP 500)"
    c = choose("t", (CLOUD, CPU), host(), exclude=frozenset({cid(CLOUD)}))
    assert reasons(c)["gpt-small"] == "failed on this call already"


def test_nothing_fits_lists_every_candidate() -> None:
    nothing = Host(now_wall=NOW, level="freeze", gpus=(gpu(24),))
    c = choose("t", (BIG_GPU, CLOUD), nothing)
    assert c.chosen is None and c.candidate is None
    text = c.explain()
    assert text.splitlines()[0] == "t: no candidate fits"
    assert "rejected: gpu qwen-7b (routes.t[0]): governor level freeze" in text
    assert "rejected: cloud gpt-small (routes.t[3]): environment variable KEY is not set" in text
