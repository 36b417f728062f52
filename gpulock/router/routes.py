"""The route table: the ``routes:`` and ``router:`` sections of the gpulock config, validated.

::

    router:
      defaults: {n_ctx: 4096, timeout: 60s}   # shared by every candidate of every task
      cooldown: 60s          # first cooldown after a failure; doubles per failure in a row, to 10m
      daily_budget: 5.00     # USD across all cloud candidates, per local day
      hold_estimate: 30s     # a GPU hold's length when the event log has no history yet
    routes:
      summarize:             # a task: its candidates, best first
        - {tier: gpu, backend: llama_cpp, model: ~/models/qwen2.5-7b-q4_k_m.gguf, n_ctx: 8192,
           min_vram: 8GiB}
        - {tier: cpu, backend: llama_cpp, model: ~/models/qwen2.5-0.5b-q8_0.gguf}
        - {tier: cloud, backend: openai, model: gpt-4o-mini, base_url: https://api.example/v1,
           api_key_env: OPENAI_API_KEY, price: {input: 0.00015, output: 0.0006}}
      digest:                # a task may inherit another's candidates, and override fields
        inherit: summarize
        n_ctx: 2048
        policy: cold-start

Every mistake is a ``ConfigError`` naming the file, the line and the key (``routes.summarize[0]
.tier``).  What can change while the config stays right (a model file not there yet, an API key
variable not set) is not an error here: the chooser rejects that candidate, with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gpulock.core.config import Config
from gpulock.core.errors import known_hint
from gpulock.router import routevalues as rv

TIERS = ("cpu", "gpu", "cloud")
BACKENDS = {"llama_cpp": ("cpu", "gpu"), "openai": ("cloud",), "tenant": ("gpu",)}
POLICIES = ("persistent", "cold-start", "api-fallback")

CANDIDATE_KEYS = (
    "tier",
    "backend",
    "model",
    "name",
    "n_ctx",
    "n_gpu_layers",
    "n_batch",
    "n_threads",
    "vram",
    "min_vram",
    "price",
    "daily_budget",
    "rate_limit",
    "base_url",
    "api_key_env",
    "policy",
    "timeout",
    "gpu",
    "max_tokens",
    "tenant",
    "keep_alive",
    "parallel",
    "tools",
    "tokenizer",
    "bytes_per_token",
)
TASK_KEYS = ("candidates", "inherit", *CANDIDATE_KEYS)
ROUTER_KEYS = ("defaults", "cooldown", "daily_budget", "hold_estimate")

DEFAULTS: dict[str, Any] = {
    "n_ctx": 2048,
    "n_batch": 512,
    "timeout": "120s",
    "max_tokens": 256,
}


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to serve a task.  ``key`` is where it is written (``routes.summarize[0]``)."""

    task: str
    key: str
    tier: str
    backend: str
    model: str  # a GGUF path (expanded) for llama_cpp, a model id for openai
    name: str  # short label: the file's stem or the model id
    n_ctx: int
    n_gpu_layers: int  # -1: all layers; 0 on the cpu tier
    n_batch: int
    n_threads: int | None
    vram_bytes: int | None  # as configured; None: estimated from the GGUF file
    min_vram_bytes: int | None
    price_in_per_1k: float  # USD per 1000 prompt tokens
    price_out_per_1k: float  # USD per 1000 completion tokens
    daily_budget_usd: float | None
    rate_limit_per_min: int | None
    base_url: str | None
    api_key_env: str | None
    policy: str
    timeout_s: float
    gpu: int | None
    max_tokens: int
    # backend "tenant": a model server of the config's tenants: list, called through its API
    # (gpulock.router.backends.tenant); ``model`` is the tenant's model name, ``base_url`` its URL.
    tenant: str | None = None
    keep_alive_s: float | None = None  # Ollama's keep_alive for a persistent call; None: its own
    parallel: int = 1  # requests `gpulock serve` runs at once under one ticket of this model
    # The cluster peer that runs it (gpulock.router.peers: its gateway is ``base_url``); None: here.
    host: str | None = None
    # Calls tools? None: as its kind does (gpulock.router.tools); False: never; True: its
    # server takes them; a llama_cpp candidate's text: the llama-cpp-python handler to use.
    tools: bool | str | None = None
    # How a call's prompt is counted for its budget reservation (gpulock.router.tokens): a
    # tiktoken encoding used when its data is on this machine, and/or the UTF-8 bytes a token
    # covers at least; neither: a token a byte.
    tokenizer: str | None = None
    bytes_per_token: float | None = None

    @property
    def local(self) -> bool:
        return self.backend == "llama_cpp"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    cooldown_s: float = 60.0
    max_cooldown_s: float = 600.0
    daily_budget_usd: float | None = None
    hold_estimate_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Table:
    tasks: Mapping[str, tuple[Candidate, ...]]
    settings: RouterSettings

    @property
    def known(self) -> list[str]:
        return sorted(self.tasks)


def load_table(cfg: Config) -> Table:
    """Validate the config's ``router:`` and ``routes:`` sections."""
    router_raw = rv.mapping(cfg, "router", cfg.section("router") or {})
    for key in router_raw:
        rv.known_key(cfg, "router", key, ROUTER_KEYS)
    defaults = dict(DEFAULTS)
    raw_defaults = rv.mapping(cfg, "router.defaults", router_raw.get("defaults") or {})
    for key in raw_defaults:
        rv.known_key(cfg, "router.defaults", key, CANDIDATE_KEYS)
    defaults.update(raw_defaults)
    settings = RouterSettings(
        cooldown_s=rv.duration(cfg, "router.cooldown", router_raw.get("cooldown", "60s")),
        daily_budget_usd=rv.money(cfg, "router.daily_budget", router_raw.get("daily_budget")),
        hold_estimate_s=rv.duration(
            cfg, "router.hold_estimate", router_raw.get("hold_estimate", "30s")
        ),
    )
    routes = rv.mapping(cfg, "routes", cfg.section("routes") or {})
    # Each candidate's fields, and where each field was written when not in the candidate
    # itself (router.defaults, an inheriting task), so that a mistake names that key.
    Item = tuple[str, dict[str, Any], dict[str, str]]
    resolved: dict[str, list[Item]] = {}

    def resolve(task: str, chain: tuple[str, ...]) -> list[Item]:
        if task in resolved:
            return resolved[task]
        key = f"routes.{task}"
        body = routes[task]
        if isinstance(body, list):
            body = {"candidates": body}
        if not isinstance(body, Mapping):
            got = "nothing" if body is None else f"{type(body).__name__}: {body!r}"
            raise cfg.error(
                key,
                f"expected a list of candidates, best first (or a mapping with candidates: "
                f"and/or inherit: TASK), got {got}",
            )
        for k in body:
            rv.known_key(cfg, key, k, TASK_KEYS)
        overrides = {k: v for k, v in body.items() if k in CANDIDATE_KEYS}
        written = dict.fromkeys(overrides, key)
        items: list[Item] = []
        if "inherit" in body:
            parent = body["inherit"]
            if not isinstance(parent, str) or parent not in routes:
                raise cfg.error(
                    f"{key}.inherit",
                    f"inherits from unknown task {parent!r}",
                    hint=known_hint(parent, sorted(map(str, routes)), "tasks"),
                )
            if parent in chain:
                cycle = " -> ".join((*chain, task, parent))
                raise cfg.error(f"{key}.inherit", f"inheritance loop: {cycle}")
            items = [
                (k, {**fields, **overrides}, {**where, **written})
                for k, fields, where in resolve(parent, (*chain, task))
            ]
        if "candidates" in body:
            cands = body["candidates"]
            ckey = key if isinstance(routes[task], list) else f"{key}.candidates"
            if not isinstance(cands, list) or not cands:
                raise cfg.error(ckey, "expected a list of candidates, best first")
            items = []
            for i, raw in enumerate(cands):
                k = f"{ckey}[{i}]"
                fields = rv.mapping(cfg, k, raw)
                for f in fields:
                    rv.known_key(cfg, k, f, CANDIDATE_KEYS)
                items.append((k, {**overrides, **fields}, {**written, **dict.fromkeys(fields, k)}))
        if not items:
            raise cfg.error(key, "a task needs candidates (a list) or inherit: TASK")
        resolved[task] = items
        return items

    from_defaults = dict.fromkeys(raw_defaults, "router.defaults")
    tasks: dict[str, tuple[Candidate, ...]] = {}
    for task in routes:
        if not isinstance(task, str) or not task:
            raise cfg.error("routes", f"a task name must be text, got {task!r}")
        tasks[task] = tuple(
            _candidate(cfg, task, k, {**defaults, **fields}, {**from_defaults, **where})
            for k, fields, where in resolve(task, ())
        )
    return Table(tasks, settings)


def _candidate(
    cfg: Config, task: str, key: str, f: dict[str, Any], where: dict[str, str]
) -> Candidate:
    """``where``: field -> the key it was written under when not the candidate's own
    (``router.defaults``, ``routes.digest``): a mistake there is named there."""
    w = _Where(key, where)
    at = w.at
    # Checked in this order: of several mistakes, the first is named.
    backend, tier = _backend_tier(cfg, f, w)
    model, label = _model(cfg, f, backend, w)
    base_url, api_key_env, tenant = _endpoint(cfg, f, backend, w)
    policy = _policy(cfg, f, tier, w)
    price_in, price_out = rv.price(cfg, at("price"), f.get("price"))
    gpu_layers = rv.whole(cfg, at("n_gpu_layers"), f.get("n_gpu_layers", -1), low=-1)
    return Candidate(
        task=task,
        key=key,
        tier=tier,
        backend=backend,
        model=model,
        name=rv.text(cfg, at("name"), f.get("name")) or label,
        n_ctx=rv.whole(cfg, at("n_ctx"), f.get("n_ctx"), low=64),
        n_gpu_layers=0 if tier == "cpu" else gpu_layers,
        n_batch=rv.whole(cfg, at("n_batch"), f.get("n_batch"), low=1),
        n_threads=rv.opt_whole(cfg, at("n_threads"), f.get("n_threads")),
        vram_bytes=rv.opt_size(cfg, at("vram"), f.get("vram")),
        min_vram_bytes=rv.opt_size(cfg, at("min_vram"), f.get("min_vram")),
        price_in_per_1k=price_in,
        price_out_per_1k=price_out,
        daily_budget_usd=rv.money(cfg, at("daily_budget"), f.get("daily_budget")),
        rate_limit_per_min=rv.opt_whole(cfg, at("rate_limit"), f.get("rate_limit")),
        base_url=base_url,
        api_key_env=api_key_env,
        policy=policy,
        timeout_s=rv.duration(cfg, at("timeout"), f.get("timeout")),
        max_tokens=rv.whole(cfg, at("max_tokens"), f.get("max_tokens"), low=1),
        tenant=tenant.name if tenant is not None else None,
        keep_alive_s=(
            None
            if f.get("keep_alive") is None
            else rv.duration(cfg, at("keep_alive"), f.get("keep_alive"))
        ),
        gpu=rv.opt_whole(cfg, at("gpu"), f.get("gpu"), low=0) if tenant is None else tenant.gpu,
        parallel=rv.whole(cfg, at("parallel"), f.get("parallel", 1), low=1),
        tools=rv.tools(cfg, at("tools"), f.get("tools"), backend),
        tokenizer=rv.tokenizer(cfg, at("tokenizer"), f.get("tokenizer")),
        bytes_per_token=rv.ratio(cfg, at("bytes_per_token"), f.get("bytes_per_token")),
    )


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a candidate's fields were written (``key``: the candidate's own place;
    ``written``: field -> elsewhere), so that a mistake is named where it was made."""

    key: str
    written: Mapping[str, str]

    def at(self, name: str) -> str:
        return f"{self.written.get(name, self.key)}.{name}"

    def of(self, name: str) -> str:
        """For a field written elsewhere, which candidate it failed on."""
        return "" if self.written.get(name, self.key) == self.key else f" (applied to {self.key})"


def _backend_tier(cfg: Config, f: Mapping[str, Any], w: _Where) -> tuple[str, str]:
    """``backend:`` (``tenant`` when a tenant is named) and the ``tier:`` it serves."""
    backend = f.get("backend", "tenant" if f.get("tenant") is not None else None)
    # Every field is type-checked before use: a mapping here is unhashable, so even the
    # lookup in BACKENDS would fail with a TypeError instead of naming the key.
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise cfg.error(
            w.at("backend"),
            f"expected one of {', '.join(BACKENDS)}, got {backend!r}",
        )
    tier = f.get("tier", {"openai": "cloud", "tenant": "gpu"}.get(backend, "cpu"))
    if not isinstance(tier, str) or tier not in BACKENDS[backend]:
        allowed = " or ".join(BACKENDS[backend])
        raise cfg.error(
            w.at("tier"), f"backend {backend} serves tier {allowed}, got {tier!r}{w.of('tier')}"
        )
    return backend, tier


def _model(cfg: Config, f: Mapping[str, Any], backend: str, w: _Where) -> tuple[str, str]:
    """``model:`` (a llama_cpp GGUF path: expanded, relative to the config file) and its label."""
    model = f.get("model")
    if not isinstance(model, str) or not model.strip():
        what = "a GGUF file path" if backend == "llama_cpp" else "a model id like gpt-4o-mini"
        raise cfg.error(w.at("model"), f"expected {what}, got {model!r}")
    if backend != "llama_cpp":
        return model, model
    model = os.path.expanduser(model)
    if not os.path.isabs(model) and cfg.path is not None:
        model = str(cfg.path.parent / model)  # relative to the config file, as people expect
    return model, os.path.splitext(os.path.basename(model))[0]


def _endpoint(
    cfg: Config, f: Mapping[str, Any], backend: str, w: _Where
) -> tuple[str | None, str | None, Any]:
    """``base_url`` and ``api_key_env`` (a tenant's own, for a tenant candidate; required, and a
    variable's name, for an openai one), and the tenant (its TenantSpec, or None)."""
    base_url = rv.text(cfg, w.at("base_url"), f.get("base_url"))
    api_key_env = rv.text(cfg, w.at("api_key_env"), f.get("api_key_env"))
    tenant = rv.tenant(cfg, w.at("tenant"), f.get("tenant"), backend)
    if tenant is not None:
        base_url, api_key_env = tenant.url, tenant.api_key_env
    if backend != "openai":
        return base_url, api_key_env, tenant
    if base_url is None:
        raise cfg.error(w.at("base_url"), "an openai candidate needs base_url")
    if api_key_env is None:
        raise cfg.error(
            w.at("api_key_env"),
            "an openai candidate needs api_key_env: the NAME of an environment variable",
            hint="keys never go in the config file: api_key_env: OPENAI_API_KEY",
        )
    if not rv.env_name(api_key_env):
        # Never echo the value: it may be the key itself, and errors end up in cron mail.
        raise cfg.error(
            w.at("api_key_env"),
            "expected an environment variable name like OPENAI_API_KEY, got a value that "
            f"looks like a key ({rv.masked(api_key_env)})",
            hint="this is the variable's name, not the key itself",
        )
    return base_url, api_key_env, tenant


def _policy(cfg: Config, f: Mapping[str, Any], tier: str, w: _Where) -> str:
    """``policy:``; a cloud candidate's is always api-fallback, a local one's never."""
    default_policy = "api-fallback" if tier == "cloud" else "persistent"
    policy = f.get("policy", default_policy)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise cfg.error(w.at("policy"), f"expected one of {', '.join(POLICIES)}, got {policy!r}")
    if tier == "cloud":
        # A task's or the defaults' residency policy is for its local candidates: a cloud
        # candidate loads nothing here, whatever it inherits.
        return "api-fallback"
    if policy == "api-fallback":
        raise cfg.error(
            w.at("policy"),
            f"api-fallback is the cloud tier's policy; a {tier} candidate is persistent or "
            f"cold-start{w.of('policy')}",
            hint="falling back along the list happens anyway: add a cloud candidate after it",
        )
    return policy


def tenant_candidate(cfg: Config, tenant: str, model: str) -> Candidate:
    """A tenant's model asked for by name, ``TENANT/MODEL`` (``gpulock serve``): a candidate as
    if a route named it, with the router's defaults; ConfigError (with the configured tenants
    as its hint) for a tenant that is not configured."""
    router_raw = cfg.section("router")
    raw_defaults = router_raw.get("defaults") if isinstance(router_raw, Mapping) else None
    defaults = {**DEFAULTS, **(raw_defaults if isinstance(raw_defaults, Mapping) else {})}
    fields = {k: v for k, v in defaults.items() if k not in ("tier", "backend", "base_url")}
    fields.update(tenant=tenant, model=model, name=f"{tenant}/{model}")
    return _candidate(cfg, f"{tenant}/{model}", f"tenants.{tenant}", fields, {})


def with_context(c: Candidate, n_ctx: int, n_batch: int) -> Candidate:
    return replace(c, n_ctx=n_ctx, n_batch=n_batch)
