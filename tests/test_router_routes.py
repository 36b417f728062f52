"""The route table (router.routes), the GGUF header reader (gpulock.core.gguf), a light import.

Every config here is a real YAML file read by ``gpulock.core.config.load_config``: a mistake must
come back as a ConfigError reading ``FILE:LINE: KEY: problem``, with the line the key is on.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulock.core import gguf as gguf_info
from gpulock.core.config import load_config
from gpulock.core.errors import ConfigError
from gpulock.router.routes import Table, load_table
from gpulock.router.tiny_model import ensure_tiny_llama, write_tiny_llama

GiB = 1024**3
MiB = 1024**2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpulock.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def table(tmp_path: Path, text: str) -> Table:
    return load_table(load_config(str(write(tmp_path, text))))


def error(tmp_path: Path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_table(load_config(str(path)))
    return info.value


def line_of(tmp_path: Path, needle: str) -> int:
    lines = (tmp_path / "gpulock.yaml").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


def assert_names(tmp_path: Path, e: ConfigError, key: str, needle: str) -> None:
    """The error names the file, the line holding ``needle`` and the key."""
    where = f"{tmp_path / 'gpulock.yaml'}:{line_of(tmp_path, needle)}: {key}: "
    assert str(e).startswith(where), str(e)
    assert e.key == key


# --- what a good table gives --------------------------------------------------------------------


def test_a_full_table(tmp_path: Path, tiny: Path) -> None:
    t = table(
        tmp_path,
        f"""
        router:
          defaults:
            n_ctx: 1024
            timeout: 30s
          cooldown: 2m
          daily_budget: $5.50
          hold_estimate: 45s
        routes:
          summarize:
            - tier: gpu
              backend: llama_cpp
              model: {tiny}
              n_ctx: 8192
              min_vram: 8GiB
              vram: 6GiB
              gpu: 1
            - tier: cpu
              backend: llama_cpp
              model: {tiny}
              n_threads: 2
            - backend: openai
              model: gpt-4o-mini
              base_url: https://api.example/v1
              api_key_env: OPENAI_API_KEY
              price:
                input: 0.00015
                output: 0.0006
              daily_budget: 2
              rate_limit: 30
        """,
    )
    assert t.known == ["summarize"]
    assert (t.settings.cooldown_s, t.settings.daily_budget_usd) == (120.0, 5.5)
    assert t.settings.hold_estimate_s == 45.0
    gpu, cpu, cloud = t.tasks["summarize"]
    assert (gpu.key, gpu.tier, gpu.name, gpu.model) == (
        "routes.summarize[0]",
        "gpu",
        "tiny-llama",
        str(tiny),
    )
    assert (gpu.n_ctx, gpu.n_gpu_layers, gpu.vram_bytes, gpu.min_vram_bytes) == (
        8192,
        -1,
        6 * GiB,
        8 * GiB,
    )
    assert (gpu.gpu, gpu.policy, gpu.timeout_s, gpu.max_tokens) == (1, "persistent", 30.0, 256)
    assert (cpu.tier, cpu.n_ctx, cpu.n_gpu_layers, cpu.n_threads) == ("cpu", 1024, 0, 2)
    assert cpu.vram_bytes is None  # estimated from the file when needed
    assert (cloud.tier, cloud.name, cloud.policy, cloud.local) == (
        "cloud",
        "gpt-4o-mini",
        "api-fallback",
        False,
    )
    assert (cloud.price_in_per_1k, cloud.price_out_per_1k) == (0.00015, 0.0006)
    assert (cloud.daily_budget_usd, cloud.rate_limit_per_min) == (2.0, 30)
    assert (cloud.base_url, cloud.api_key_env) == ("https://api.example/v1", "OPENAI_API_KEY")


def test_defaults_inherit_and_overrides(tmp_path: Path) -> None:
    t = table(
        tmp_path,
        """
        router:
          defaults:
            n_ctx: 1024
            max_tokens: 99
        routes:
          summarize:
            - tier: cpu
              backend: llama_cpp
              model: a.gguf
            - tier: cpu
              backend: llama_cpp
              model: b.gguf
              n_ctx: 4096
          digest:
            inherit: summarize
            n_ctx: 2048
            policy: cold-start
          brief:
            inherit: digest
            max_tokens: 10
          other:
            inherit: summarize
            candidates:
              - tier: cpu
                backend: llama_cpp
                model: c.gguf
        """,
    )
    a, b = t.tasks["summarize"]
    assert (a.n_ctx, a.max_tokens, a.policy) == (1024, 99, "persistent")  # router.defaults
    assert b.n_ctx == 4096  # the candidate's own value beats the defaults
    d0, d1 = t.tasks["digest"]
    assert (d0.task, d0.key, d0.name) == ("digest", "routes.summarize[0]", "a")
    # the inheriting task's overrides beat both the defaults and the parent's candidates
    assert [(c.n_ctx, c.policy) for c in (d0, d1)] == [(2048, "cold-start")] * 2
    assert [(c.n_ctx, c.policy, c.max_tokens) for c in t.tasks["brief"]] == [
        (2048, "cold-start", 10)
    ] * 2
    # own candidates replace the inherited ones; the task-level fields still apply
    (only,) = t.tasks["other"]
    assert (only.name, only.key) == ("c", "routes.other.candidates[0]")


def test_model_paths_resolve_against_the_config_folder_and_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    t = table(
        tmp_path,
        """
        routes:
          t:
            - backend: llama_cpp
              model: models/m.gguf
            - backend: llama_cpp
              model: ~/models/h.gguf
            - backend: llama_cpp
              model: /abs/a.gguf
        """,
    )
    rel, home, absolute = t.tasks["t"]
    assert rel.model == str(tmp_path / "models" / "m.gguf")
    assert rel.tier == "cpu"  # llama_cpp's default tier
    assert home.model == str(tmp_path / "home" / "models" / "h.gguf")
    assert absolute.model == "/abs/a.gguf"


def test_a_config_without_routes_has_no_tasks(tmp_path: Path) -> None:
    t = table(tmp_path, "reserve: 1GiB\n")
    assert t.known == [] and t.settings.cooldown_s == 60.0


# --- what a bad table says ------------------------------------------------------------------------

CPU = """
        routes:
          t:
            - tier: cpu
              backend: llama_cpp
              model: m.gguf
"""


def test_unknown_candidate_key_suggests_the_right_one(tmp_path: Path) -> None:
    e = error(tmp_path, CPU + "              n_ctxx: 512\n")
    assert_names(tmp_path, e, "routes.t[0].n_ctxx", "n_ctxx")
    assert (e.hint or "").startswith("did you mean 'n_ctx'? known keys: ")


def test_unknown_router_and_defaults_keys(tmp_path: Path) -> None:
    e = error(tmp_path, "router:\n  cooldwn: 5s\n")
    assert_names(tmp_path, e, "router.cooldwn", "cooldwn")
    assert (e.hint or "").startswith("did you mean 'cooldown'? known keys: ")
    e = error(tmp_path, "router:\n  defaults:\n    temprature: 0.5\n")
    assert_names(tmp_path, e, "router.defaults.temprature", "temprature")


def test_an_unknown_task_level_key(tmp_path: Path) -> None:
    e = error(tmp_path, "routes:\n  t:\n    inherits: x\n")
    assert_names(tmp_path, e, "routes.t.inherits", "inherits")
    assert (e.hint or "").startswith("did you mean 'inherit'? known keys: ")


@pytest.mark.parametrize(
    ("tier", "backend", "key", "problem"),
    [
        ("gpu", "openai", "tier", "backend openai serves tier cloud, got 'gpu'"),
        ("cloud", "llama_cpp", "tier", "backend llama_cpp serves tier cpu or gpu, got 'cloud'"),
        ("cpu", "vllm", "backend", "expected one of llama_cpp, openai, tenant, got 'vllm'"),
        ("tpu", "llama_cpp", "tier", "backend llama_cpp serves tier cpu or gpu, got 'tpu'"),
    ],
)
def test_bad_tier_backend_combinations(
    tmp_path: Path, tier: str, backend: str, key: str, problem: str
) -> None:
    text = f"""
        routes:
          t:
            - tier: {tier}
              backend: {backend}
              model: m
              base_url: http://127.0.0.1:1/v1
              api_key_env: KEY
        """
    e = error(tmp_path, text)
    assert_names(tmp_path, e, f"routes.t[0].{key}", f"{key}: ")
    assert e.problem == problem


def test_missing_model(tmp_path: Path) -> None:
    e = error(tmp_path, "routes:\n  t:\n    - tier: cpu\n      backend: llama_cpp\n")
    assert str(e).startswith(f"{tmp_path / 'gpulock.yaml'}:3: routes.t[0].model: expected a GGUF")
    e = error(tmp_path, "routes:\n  t:\n    - backend: openai\n      model: '  '\n")
    assert "routes.t[0].model: expected a model id like gpt-4o-mini" in str(e)


OPENAI = """
        routes:
          t:
            - backend: openai
              model: gpt-4o-mini
"""


def test_openai_needs_base_url_and_api_key_env(tmp_path: Path) -> None:
    e = error(tmp_path, OPENAI + "              api_key_env: KEY\n")
    assert e.key == "routes.t[0].base_url"
    assert e.problem == "an openai candidate needs base_url"
    e = error(tmp_path, OPENAI + "              base_url: https://api.example/v1\n")
    assert e.key == "routes.t[0].api_key_env"
    assert e.hint == "keys never go in the config file: api_key_env: OPENAI_API_KEY"


@pytest.mark.parametrize(
    "pasted",
    [
        "sk-proj-Zq7wN3xT9vB2mK5pL8rJ4hF6",
        "sk_live_Zq7wN3xT9vB2mK5pL8rJ4hF6",
        "Zq7w-N3xT9vB2mK5pL8r",
    ],
)
def test_a_key_pasted_into_api_key_env_is_refused_without_echoing_it(
    tmp_path: Path, pasted: str
) -> None:
    e = error(
        tmp_path,
        OPENAI + f"              base_url: https://api.example/v1\n"
        f"              api_key_env: {pasted}\n",
    )
    assert_names(tmp_path, e, "routes.t[0].api_key_env", "api_key_env")
    assert e.hint == "this is the variable's name, not the key itself"
    # error messages end up in logs and cron mail: the key must not be in them
    assert "Zq7" not in str(e) and "Zq7" not in repr(e) and "Zq7" not in (e.hint or "")
    assert f"{len(pasted)} characters" in str(e)


@pytest.mark.parametrize(
    ("field", "value", "key", "needle"),
    [
        ("vram", "lots", "routes.t[0].vram", "is not a size"),
        ("min_vram", "0", "routes.t[0].min_vram", "expected a size above 0"),
        ("timeout", "soon", "routes.t[0].timeout", "is not a duration"),
        ("timeout", "0s", "routes.t[0].timeout", "expected a duration above 0"),
        ("price", "cheap", "routes.t[0].price", "expected an amount in USD like 5.00"),
        ("price", "-1", "routes.t[0].price", "expected an amount in USD >= 0"),
        ("daily_budget", "five", "routes.t[0].daily_budget", "expected an amount in USD"),
        ("rate_limit", "0", "routes.t[0].rate_limit", "expected a whole number >= 1"),
        ("n_ctx", "10", "routes.t[0].n_ctx", "expected a whole number >= 64, got 10"),
        ("n_ctx", "true", "routes.t[0].n_ctx", "expected a whole number >= 64, got True"),
        ("n_gpu_layers", "-2", "routes.t[0].n_gpu_layers", "expected a whole number >= -1"),
        ("gpu", "-1", "routes.t[0].gpu", "expected a whole number >= 0"),
        ("policy", "sometimes", "routes.t[0].policy", "expected one of persistent, cold-start"),
    ],
)
def test_bad_values_name_their_key(
    tmp_path: Path, field: str, value: str, key: str, needle: str
) -> None:
    e = error(tmp_path, CPU + f"              {field}: {value}\n")
    assert_names(tmp_path, e, key, f"{field}: {value}")
    assert needle in e.problem, e.problem


def test_bad_price_mapping_and_router_values(tmp_path: Path) -> None:
    e = error(tmp_path, CPU + "              price:\n                inputs: 0.1\n")
    assert_names(tmp_path, e, "routes.t[0].price.inputs", "inputs")
    assert (e.hint or "").startswith("did you mean 'input'? known keys: ")
    e = error(tmp_path, CPU + "              price:\n                output: -3\n")
    assert_names(tmp_path, e, "routes.t[0].price.output", "output")
    e = error(tmp_path, "router:\n  cooldown: never\n")
    assert_names(tmp_path, e, "router.cooldown", "cooldown")
    e = error(tmp_path, "router:\n  daily_budget: lots\n")
    assert_names(tmp_path, e, "router.daily_budget", "daily_budget")


OPENAI_TOO = """
            - backend: openai
              model: gpt-4o-mini
              base_url: https://api.example/v1
              api_key_env: KEY
"""


def test_a_bad_inherited_or_default_field_is_named_where_it_is_written(tmp_path: Path) -> None:
    both = CPU + OPENAI_TOO
    e = error(
        tmp_path, both + "          digest:\n            inherit: t\n            n_ctx: big\n"
    )
    assert_names(tmp_path, e, "routes.digest.n_ctx", "n_ctx: big")
    e = error(tmp_path, both + "          digest:\n            inherit: t\n            tier: gpu\n")
    assert_names(tmp_path, e, "routes.digest.tier", "tier: gpu")
    assert e.problem == "backend openai serves tier cloud, got 'gpu' (applied to routes.t[1])"
    defaults = "        router:\n          defaults:\n            timeout: soon\n"
    e = error(tmp_path, defaults + CPU)
    assert_names(tmp_path, e, "router.defaults.timeout", "timeout: soon")


def test_api_fallback_is_the_cloud_tiers_policy(tmp_path: Path) -> None:
    e = error(tmp_path, CPU + "              policy: api-fallback\n")
    assert_names(tmp_path, e, "routes.t[0].policy", "policy: api-fallback")
    assert e.problem == (
        "api-fallback is the cloud tier's policy; a cpu candidate is persistent or cold-start"
    )
    # a task-wide policy is for the local candidates: the cloud one stays api-fallback
    t = table(
        tmp_path,
        CPU + OPENAI_TOO + "          d:\n            inherit: t\n            policy: cold-start\n",
    )
    assert [c.policy for c in t.tasks["d"]] == ["cold-start", "api-fallback"]


def test_inherit_loop(tmp_path: Path) -> None:
    loop = "routes:\n  a:\n    inherit: b\n  b:\n    inherit: c\n  c:\n    inherit: a\n"
    e = error(tmp_path, loop)
    assert e.key is not None and e.key.endswith(".inherit")
    assert "inheritance loop: a -> b -> c -> a" in e.problem


def test_inherit_from_an_unknown_task(tmp_path: Path) -> None:
    e = error(tmp_path, CPU + "          digest:\n            inherit: summarise\n")
    assert_names(tmp_path, e, "routes.digest.inherit", "inherit: summarise")
    assert e.problem == "inherits from unknown task 'summarise'"
    assert e.hint == "tasks: digest, t"


@pytest.mark.parametrize(
    ("body", "key", "line", "problem"),
    [
        ("[]", "routes.t", 2, "expected a list of candidates, best first"),
        ("{}", "routes.t", 2, "a task needs candidates (a list) or inherit: TASK"),
        ("", "routes.t", 2, "expected a list of candidates, best first (or a mapping"),
        ("\n    candidates: nope", "routes.t.candidates", 3, "expected a list of candidates"),
    ],
)
def test_empty_tasks(tmp_path: Path, body: str, key: str, line: int, problem: str) -> None:
    e = error(tmp_path, f"routes:\n  t: {body}\n")
    assert e.problem.startswith(problem)
    assert e.key == key
    assert str(e).startswith(f"{tmp_path / 'gpulock.yaml'}:{line}: {key}: ")


def test_sections_of_the_wrong_shape(tmp_path: Path) -> None:
    e = error(tmp_path, "routes:\n  - summarize\n")
    assert (e.key, e.problem) == ("routes", "expected a mapping, got list: ['summarize']")
    e = error(tmp_path, "routes:\n  t:\n    - just-a-string\n")
    assert e.key == "routes.t[0]"


# --- the GGUF header ------------------------------------------------------------------------------


def test_read_info_gives_the_tiny_models_real_numbers(tiny: Path) -> None:
    info = gguf_info.read_info(str(tiny))
    sizes = inspect.signature(
        write_tiny_llama
    ).parameters  # what gpulock/router/tiny_model.py writes
    assert info.architecture == "llama"
    assert info.block_count == sizes["n_layer"].default == 2
    assert info.embedding_length == sizes["n_embd"].default == 64
    assert info.head_count == sizes["n_head"].default == 4
    assert info.head_count_kv == 4  # no grouped-query attention
    assert info.file_bytes == tiny.stat().st_size
    assert gguf_info.read_info(str(tiny)) is info  # cached while the file is unchanged


def test_read_info_follows_other_sizes(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", n_layer=3, n_embd=32, n_head=2, n_ff=48)
    info = gguf_info.read_info(str(path))
    assert (info.block_count, info.embedding_length, info.head_count) == (3, 32, 2)


def test_the_vram_estimate(tiny: Path) -> None:
    info = gguf_info.read_info(str(tiny))
    size = tiny.stat().st_size
    kv = 2 * 2 * 512 * 64 * 2  # K and V, 2 layers, 512 positions, width 64, f16
    compute = 64 * MiB + 512 * 64 * 4 * 4
    assert gguf_info.estimate_vram(info, n_ctx=512, n_gpu_layers=-1) == size + kv + compute
    half = gguf_info.estimate_vram(info, n_ctx=512, n_gpu_layers=1)
    assert half == size // 2 + kv // 2 + compute
    assert gguf_info.estimate_vram(info, n_ctx=512, n_gpu_layers=0) == 0
    bigger = gguf_info.estimate_vram(info, n_ctx=4096, n_gpu_layers=-1)
    assert bigger > gguf_info.estimate_vram(info, n_ctx=512, n_gpu_layers=-1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda good: b"PK\x03\x04 a zip, not a model", "not a GGUF file"),
        (lambda good: b"", "not a GGUF file"),
        (lambda good: good[:6], "ends early"),
        (lambda good: good[:200], "ends early"),
        (lambda good: b"GGUF" + (1).to_bytes(4, "little") + good[8:], "too old"),
    ],
)
def test_a_bad_file_is_a_gguf_error(tmp_path: Path, tiny: Path, make: object, match: str) -> None:
    path = tmp_path / "bad.gguf"
    assert callable(make)
    path.write_bytes(make(tiny.read_bytes()))
    with pytest.raises(gguf_info.GGUFError, match=match):
        gguf_info.read_info(str(path))


def test_a_damaged_string_length_is_caught(tmp_path: Path, tiny: Path) -> None:
    good = bytearray(tiny.read_bytes())
    good[24:32] = (1 << 40).to_bytes(8, "little")  # the first key's length
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(good))
    with pytest.raises(gguf_info.GGUFError, match="damaged"):
        gguf_info.read_info(str(path))


def test_a_broken_gguf_leaves_get_model_without_an_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpulock import router

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00")  # ends early
    config = write(
        tmp_path,
        f"""
        simulate: 24GiB
        routes:
          t:
            - tier: gpu
              backend: llama_cpp
              model: {bad}
        """,
    )
    monkeypatch.setenv("GPULOCK_STATE_DIR", str(tmp_path / "state"))
    m = router.get_model("t", config=str(config))  # chooses; loads nothing yet
    assert m.choice.chosen is not None
    assert m.choice.chosen.need_bytes is None  # no estimate: the lock will take the whole GPU
    assert m.choice.chosen.reason == "gpu0: needs the whole GPU"
    assert router.explain("t", config=str(config)).chosen == m.choice.chosen


# --- importing the router stays light -------------------------------------------------------------


def test_import_router_is_light() -> None:
    code = (
        "import sys, gpulock.router, gpulock.router.cli, gpulock.router.select; "
        "import gpulock.router.model, gpulock.router.routes; "
        "heavy = ('llama_cpp', 'openai', 'torch', 'apscheduler', 'numpy', 'gguf', 'httpx'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
