from __future__ import annotations

import grp
import os
import pathlib
import pickle
import textwrap

import pytest

from gpulock.core import configfile
from gpulock.core.config import DEFAULTS, SECTIONS, Config, load_config, parse_config
from gpulock.core.configfile import find_config
from gpulock.core.errors import ConfigError

MIB = 1024**2
GIB = 1024**3
FILE = "/etc/fleet/cfg.yaml"


def parse(text: str, file: str = FILE) -> Config:
    return parse_config(textwrap.dedent(text).removeprefix("\n"), file)


def fails(text: str, file: str = FILE) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse(text, file)
    return caught.value


def current_group() -> str:
    return grp.getgrgid(os.getgid()).gr_name


# --- lookup order ----------------------------------------------------------------------------


@pytest.fixture
def places(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, pathlib.Path]:
    """Every place a config can be, each holding one, plus a fake environ pointing at them."""
    home = tmp_path / "home"
    work = tmp_path / "work"
    system = tmp_path / "etc" / "gpulock" / "config.yaml"
    monkeypatch.setattr(configfile, "SYSTEM_CONFIG", system)
    paths = {
        "explicit": tmp_path / "explicit.yaml",
        "env": tmp_path / "env.yaml",
        "local": work / "gpulock.yaml",
        "user": home / ".config" / "gpulock" / "config.yaml",
        "system": system,
    }
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("default_gpu: 1\n")
    paths["home"] = home
    paths["work"] = work
    return paths


def env_for(places: dict[str, pathlib.Path], **extra: str) -> dict[str, str]:
    return {"HOME": str(places["home"]), **extra}


def test_explicit_wins_over_everything(places: dict[str, pathlib.Path]) -> None:
    environ = env_for(places, GPULOCK_CONFIG=str(places["env"]))
    found = find_config(str(places["explicit"]), environ, str(places["work"]))
    assert found == places["explicit"]


def test_env_wins_over_the_search_path(places: dict[str, pathlib.Path]) -> None:
    environ = env_for(places, GPULOCK_CONFIG=str(places["env"]))
    assert find_config(None, environ, str(places["work"])) == places["env"]


def test_empty_env_is_unset(places: dict[str, pathlib.Path]) -> None:
    environ = env_for(places, GPULOCK_CONFIG="")
    assert find_config(None, environ, str(places["work"])) == places["local"]


def test_local_file_wins_over_user_and_system(places: dict[str, pathlib.Path]) -> None:
    assert find_config(None, env_for(places), str(places["work"])) == places["local"]


def test_user_file_wins_over_system(places: dict[str, pathlib.Path]) -> None:
    places["local"].unlink()
    assert find_config(None, env_for(places), str(places["work"])) == places["user"]


def test_system_file_last(places: dict[str, pathlib.Path]) -> None:
    places["local"].unlink()
    places["user"].unlink()
    assert find_config(None, env_for(places), str(places["work"])) == places["system"]


def test_no_file_means_none(places: dict[str, pathlib.Path]) -> None:
    for name in ("local", "user", "system"):
        places[name].unlink()
    assert find_config(None, env_for(places), str(places["work"])) is None


def test_no_file_means_defaults(
    places: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("local", "user", "system"):
        places[name].unlink()
    monkeypatch.chdir(places["work"])
    assert load_config(None, env_for(places)) == Config()
    assert Config().path is None


def test_load_config_reads_the_found_file(
    places: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(places["work"])
    places["local"].write_text("# local\ndefault_gpu: 3\n")
    loaded = load_config(None, env_for(places))
    assert loaded.path == places["local"]
    assert loaded.default_gpu == 3
    assert loaded.lines["default_gpu"] == 2


def test_missing_explicit_file_is_an_error(places: dict[str, pathlib.Path]) -> None:
    missing = places["work"] / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        find_config(str(missing), env_for(places), str(places["work"]))
    assert str(caught.value).startswith(f"{missing}: no such config file (given with --config)")
    assert caught.value.file == str(missing)


def test_missing_env_file_is_an_error(places: dict[str, pathlib.Path]) -> None:
    missing = places["work"] / "nope.yaml"
    environ = env_for(places, GPULOCK_CONFIG=str(missing))
    with pytest.raises(ConfigError, match=r"nope\.yaml: no such config file \(named by \$GPULOCK"):
        find_config(None, environ, str(places["work"]))


def test_explicit_folder_is_an_error(places: dict[str, pathlib.Path]) -> None:
    with pytest.raises(ConfigError, match="is a folder"):
        find_config(str(places["work"]), env_for(places))


def test_explicit_relative_path_is_relative_to_cwd(places: dict[str, pathlib.Path]) -> None:
    found = find_config("gpulock.yaml", env_for(places), str(places["work"]))
    assert found == places["work"] / "gpulock.yaml"


def test_explicit_tilde_uses_home(places: dict[str, pathlib.Path]) -> None:
    found = find_config("~/.config/gpulock/config.yaml", env_for(places))
    assert found == places["user"]


def test_home_unset_falls_back_to_passwd(
    places: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    fake_home = places["home"]
    monkeypatch.setattr(
        pwd, "getpwuid", lambda uid: type("Entry", (), {"pw_dir": str(fake_home)})()
    )
    places["local"].unlink()
    assert find_config(None, {}, str(places["work"])) == places["user"]


def test_unreadable_or_broken_file_is_reported(
    places: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    places["local"].write_bytes(b"default_gpu: 1\n\xff\xfe\n")
    monkeypatch.chdir(places["work"])
    with pytest.raises(ConfigError) as caught:
        load_config(None, env_for(places))
    assert "gpulock.yaml:2: is not UTF-8 text" in str(caught.value)


# --- documents without keys ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["", "\n\n", "# only a comment\n# and another\n", "---\n", "null\n"]
)
def test_empty_file_is_defaults(text: str) -> None:
    parsed = parse_config(text, FILE)
    assert parsed == Config(path=pathlib.Path(FILE))


def test_defaults() -> None:
    c = Config()
    assert c.path is None
    assert c.state_dir is None
    assert c.group is None
    assert c.default_gpu == 0
    assert c.simulate_bytes is None
    assert c.reserve == "10%"
    assert c.reserve_bytes(1000) == 100
    assert c.on_hung == "report"
    assert c.hung_grace_s == 10.0
    assert c.events_max_bytes == 10 * MIB
    assert dict(c.sections) == {}
    assert dict(c.lines) == {}


def test_defaults_mapping_covers_every_key() -> None:
    assert set(DEFAULTS) == {
        "state_dir",
        "group",
        "default_gpu",
        "simulate",
        "reserve",
        "on_hung",
        "hung_grace",
        "exit_wait",
        "events_max_bytes",
        "exclusive_clears_tenants",
        "exclusive_clears_residents",
    }
    assert not set(DEFAULTS) & SECTIONS


@pytest.mark.parametrize("key", ["exclusive_clears_tenants", "exclusive_clears_residents"])
def test_exclusive_clears_keys_are_booleans(key: str) -> None:
    assert getattr(Config(), key) is True
    assert getattr(parse(f"{key}: false\n"), key) is False
    with pytest.raises(ConfigError) as e:
        parse(f"{key}: maybe\n")
    assert key in str(e.value) and "expected true or false" in str(e.value), e.value


def test_every_key_at_once() -> None:
    c = parse(
        f"""
        # the fleet's config
        state_dir: /srv/gpulock
        group: {current_group()}
        default_gpu: 1
        simulate: 24GiB,12GiB
        reserve: 2GiB
        on_hung: kill
        hung_grace: 30s
        events_max_bytes: 1MiB
        """
    )
    assert c.path == pathlib.Path(FILE)
    assert c.state_dir == pathlib.Path("/srv/gpulock")
    assert c.group == current_group()
    assert c.default_gpu == 1
    assert c.simulate_bytes == (24 * GIB, 12 * GIB)
    assert c.reserve == "2GiB"
    assert c.reserve_bytes(24 * GIB) == 2 * GIB
    assert c.on_hung == "kill"
    assert c.hung_grace_s == 30.0
    assert c.events_max_bytes == MIB
    assert c.lines["state_dir"] == 2
    assert c.lines["events_max_bytes"] == 9


# --- each key, good and bad ------------------------------------------------------------------


def test_state_dir_expands_tilde() -> None:
    c = parse("state_dir: ~/gpulock-state\n")
    assert c.state_dir == pathlib.Path(os.path.expanduser("~/gpulock-state"))


def test_relative_state_dir_is_relative_to_the_file() -> None:
    c = parse("state_dir: state\n", "/etc/fleet/cfg.yaml")
    assert c.state_dir == pathlib.Path("/etc/fleet/state")


def test_null_state_dir_is_default() -> None:
    assert parse("state_dir:\n").state_dir is None


@pytest.mark.parametrize(
    ("value", "got"), [("''", "got ''"), ("3", "got 3"), ("[a, b]", "got a list")]
)
def test_state_dir_bad(value: str, got: str) -> None:
    error = fails(f"default_gpu: 0\nstate_dir: {value}\n")
    assert str(error).startswith(f"{FILE}:2: state_dir: expected a folder path, {got}")
    assert (error.file, error.line, error.key) == (FILE, 2, "state_dir")


def test_group_unknown() -> None:
    error = fails("# a comment\n\ngroup: no-such-group-here\n")
    assert str(error).startswith(f"{FILE}:3: group: unknown group 'no-such-group-here'")
    assert error.hint is not None and "groupadd" in error.hint


def test_group_not_a_name() -> None:
    error = fails("group: 1000\n")
    assert str(error).startswith(f"{FILE}:1: group: expected a group name, got 1000")


@pytest.mark.parametrize(
    ("value", "expected", "spec"),
    [
        ("0", 0, 0),
        ("3", 3, 3),
        ("'1'", 1, 1),
        ("any", 0, "any"),
        ("0,2", 0, (0, 2)),
        ("[3, 1]", 1, (1, 3)),
        ("[2]", 2, 2),
    ],
)
def test_default_gpu_good(value: str, expected: int, spec: object) -> None:
    """One GPU, a set, or any (issue 28); ``default_gpu`` stays the one GPU of things that
    live on one (a resident, a tenant without gpu:): the set's first."""
    cfg = parse(f"default_gpu: {value}\n")
    assert (cfg.default_gpu, cfg.default_gpus) == (expected, spec)


@pytest.mark.parametrize(
    ("value", "got"),
    [
        ("one", "got 'one'"),
        ("-1", "got -1"),
        ("1.5", "got 1.5"),
        ("true", "got true"),
        ("", "got null"),
        ("[]", "got a list"),
        ("'0,x'", "got '0,x'"),
    ],
)
def test_default_gpu_bad(value: str, got: str) -> None:
    error = fails(f"# comment\non_hung: report\ndefault_gpu: {value}\n")
    assert str(error) == (
        f"{FILE}:3: default_gpu: expected a GPU index >= 0, a set such as 0,2, or any; {got}"
    )
    assert error.hint and "default_gpu: any" in error.hint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("simulate: 24GiB\n", (24 * GIB,)),
        ("simulate: 24GiB,12GiB\n", (24 * GIB, 12 * GIB)),
        ("simulate: '24GiB, 12GiB'\n", (24 * GIB, 12 * GIB)),
        ("simulate: [24GiB, 12GiB]\n", (24 * GIB, 12 * GIB)),
        ("simulate:\n  - 24GiB\n  - 1073741824\n", (24 * GIB, GIB)),
        ("simulate: 1073741824\n", (GIB,)),
        ("simulate:\n", None),
    ],
)
def test_simulate_good(text: str, expected: tuple[int, ...] | None) -> None:
    assert parse(text).simulate_bytes == expected


@pytest.mark.parametrize(
    ("text", "where", "fragment"),
    [
        ("simulate: banana\n", "1: simulate", "'banana' is not a size"),
        ("simulate: 24GiB,\n", "1: simulate", "'' is not a size"),
        ("simulate: 0\n", "1: simulate", "expected a size above zero, got 0"),
        ("simulate: 10%\n", "1: simulate", "percentage"),
        ("simulate: []\n", "1: simulate", "expected one size per GPU"),
        ("simulate: {a: 1}\n", "1: simulate", "got a mapping"),
        ("simulate:\n  - 24GiB\n  - lots\n", "3: simulate[1]", "'lots' is not a size"),
        ("simulate:\n  - 24GiB\n  - true\n", "3: simulate[1]", "got true"),
    ],
)
def test_simulate_bad(text: str, where: str, fragment: str) -> None:
    error = fails(text)
    assert str(error).startswith(f"{FILE}:{where}: ")
    assert fragment in str(error)


@pytest.mark.parametrize(
    ("text", "where", "guess"),
    [
        ("simulate: 24\n", "1: simulate", "24GiB"),
        ("simulate: 24,12GiB\n", "1: simulate", "24GiB"),
        ("simulate:\n  - 24GiB\n  - 12MiB\n", "3: simulate[1]", "12GiB"),
    ],
)
def test_a_simulated_gpu_under_64_mib_is_a_unit_left_out(text: str, where: str, guess: str) -> None:
    error = fails(text)
    assert str(error).startswith(f"{FILE}:{where}: a GPU of "), error
    assert "too small to simulate (at least 64.0 MiB" in str(error), error
    assert error.hint == f"did you mean {guess}?"


def test_a_simulated_gpu_of_64_mib_is_small_but_fine() -> None:
    assert parse("simulate: 64MiB\n").simulate_bytes == (64 * MIB,)


@pytest.mark.parametrize(
    ("value", "stored", "total", "reserve"),
    [
        ("10%", "10%", 1000, 100),
        ("2GiB", "2GiB", 24 * GIB, 2 * GIB),
        ("1073741824", 1073741824, 24 * GIB, GIB),
        ("1.5e+3", 1500, 10_000, 1500),
        ("0", 0, 1000, 0),
        ("2GiB", "2GiB", GIB, GIB),  # never more than the GPU itself
    ],
)
def test_reserve_good(value: str, stored: str | int, total: int, reserve: int) -> None:
    c = parse(f"reserve: {value}\n")
    assert c.reserve == stored
    assert c.reserve_bytes(total) == reserve


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("lots", "'lots' is not a size: expected a size like 6GiB, 800MiB or 10%"),
        ("-1GiB", "'-1GiB' is negative"),
        ("150%", "more than 100%"),
        ("yes", "got true"),
        ("", "got null"),
    ],
)
def test_reserve_bad(value: str, fragment: str) -> None:
    error = fails(f"default_gpu: 0\n\nreserve: {value}\n")
    assert str(error).startswith(f"{FILE}:3: reserve: ")
    assert fragment in str(error)


def test_reserve_bytes_reports_a_bad_reserve_like_the_file() -> None:
    with pytest.raises(ConfigError, match="reserve: 'lots' is not a size"):
        Config(reserve="lots").reserve_bytes(GIB)


@pytest.mark.parametrize("value", ["report", "kill"])
def test_on_hung_good(value: str) -> None:
    assert parse(f"on_hung: {value}\n").on_hung == value


@pytest.mark.parametrize(("value", "got"), [("kil", "'kil'"), ("KILL", "'KILL'"), ("1", "1")])
def test_on_hung_bad(value: str, got: str) -> None:
    error = fails(f"default_gpu: 0\non_hung: {value}\n")
    assert str(error) == f"{FILE}:2: on_hung: expected 'report' or 'kill', got {got}"


@pytest.mark.parametrize(("value", "seconds"), [("10", 10.0), ("2.5", 2.5), ("1m", 60.0)])
def test_hung_grace_good(value: str, seconds: float) -> None:
    assert parse(f"hung_grace: {value}\n").hung_grace_s == seconds


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("soon", "'soon' is not a duration"), ("-1s", "is negative"), ("[1]", "got a list")],
)
def test_hung_grace_bad(value: str, fragment: str) -> None:
    error = fails(f"# a comment\nhung_grace: {value}\n")
    assert str(error).startswith(f"{FILE}:2: hung_grace: ")
    assert fragment in str(error)


def test_events_max_bytes_good() -> None:
    assert parse("events_max_bytes: 64MiB\n").events_max_bytes == 64 * MIB
    assert parse("events_max_bytes: 4096\n").events_max_bytes == 4096


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("0", "above zero"), ("big", "'big' is not a size"), ("5%", "percentage")],
)
def test_events_max_bytes_bad(value: str, fragment: str) -> None:
    error = fails(f"events_max_bytes: {value}\n")
    assert str(error).startswith(f"{FILE}:1: events_max_bytes: ")
    assert fragment in str(error)


# --- document-level errors -------------------------------------------------------------------


def test_unknown_key_suggests_the_close_one() -> None:
    error = fails("default_gpu: 0\non_hungg: kill\n")
    assert str(error) == f"{FILE}:2: unknown key 'on_hungg'"
    assert error.key == "on_hungg"
    assert error.hint is not None
    assert error.hint.startswith("did you mean 'on_hung'?")
    assert "known keys:" in error.hint and "routes" in error.hint and "reserve" in error.hint


def test_unknown_key_without_a_close_one() -> None:
    error = fails("zzzzzz: 1\n")
    assert str(error) == f"{FILE}:1: unknown key 'zzzzzz'"
    assert error.hint is not None and "did you mean" not in error.hint


def test_unknown_non_string_key() -> None:
    assert str(fails("# a comment\n1: x\n")) == f"{FILE}:2: unknown key 1"


def test_duplicate_top_level_key() -> None:
    error = fails("default_gpu: 0\nreserve: 1GiB\ndefault_gpu: 1\n")
    assert str(error) == f"{FILE}:3: default_gpu: duplicate key (first set on line 1)"


def test_duplicate_key_inside_a_section() -> None:
    error = fails(
        """
        routes:
          summarize:
            model: a
            model: b
        """
    )
    assert str(error) == f"{FILE}:4: routes.summarize.model: duplicate key (first set on line 3)"


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("default_gpu: 0\nreserve: [1GiB\non_hung: kill\n", 3, "invalid YAML: expected ','"),
        ("default_gpu: 0\n  reserve: 1GiB\n", 2, "invalid YAML: mapping values are not allowed"),
        ("default_gpu: 0\nrouter: 'open\n", 3, "invalid YAML"),
        ("a: 1\n---\nb: 2\n", 2, "a second document starts here"),
        ("default_gpu: !weird 1\n", 1, "could not determine a constructor for the tag '!weird'"),
    ],
)
def test_yaml_syntax_error_has_the_line(text: str, line: int, fragment: str) -> None:
    error = fails(text)
    assert str(error).startswith(f"{FILE}:{line}: ")
    assert fragment in str(error)
    assert error.line == line


def test_tab_indentation_gets_a_hint() -> None:
    error = fails("routes:\n\tsummarize: x\n")
    assert str(error).startswith(f"{FILE}:2: invalid YAML")
    assert error.hint == "YAML indents with spaces, never tabs"


def test_control_character_is_reported_with_its_line() -> None:
    error = fails("default_gpu: 0\nreserve: 1\x00GiB\n")
    assert str(error).startswith(f"{FILE}:2: invalid YAML: special characters are not allowed")


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "a list"), ("just words\n", "a single value")]
)
def test_top_level_must_be_a_mapping(text: str, kind: str) -> None:
    error = fails(text)
    assert str(error).startswith(f"{FILE}:1: the top level must be a mapping of keys to values")
    assert kind in str(error)


def test_alias_cycle_is_an_error() -> None:
    error = fails("routes: &loop [1, *loop]\n")
    assert "alias refers to a collection that contains it" in str(error)


def test_alias_bomb_is_stopped() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8)]
    text = "router:\n" + "".join(f"  {line}\n" for line in lines)
    assert "more than 100000 values" in str(fails(text))


def test_complex_key_is_an_error() -> None:
    error = fails("routes:\n  ? [a, b]\n  : 1\n")
    assert str(error).startswith(f"{FILE}:2: a key must be a plain value")


def test_errors_pickle() -> None:
    error = fails("default_gpu: one\n")
    again = pickle.loads(pickle.dumps(error))  # noqa: S301 -- our own bytes, made one line up
    assert str(again) == str(error)
    assert (again.file, again.line, again.key) == (FILE, 1, "default_gpu")


# --- sections of other packages --------------------------------------------------------------

SECTIONED = """
# gpulock's own keys first
default_gpu: 0
routes:
  summarize:
    - backend: local
      model: qwen2.5-7b
      max_tokens: 512
    - backend: cloud
      model: gpt-4o-mini
governor:
  quiet_from: "22:00"
  budgets: {daily_usd: 5}
watchdog:
"""


def test_sections_are_kept_raw() -> None:
    c = parse(SECTIONED)
    assert c.sections["routes"] == {
        "summarize": [
            {"backend": "local", "model": "qwen2.5-7b", "max_tokens": 512},
            {"backend": "cloud", "model": "gpt-4o-mini"},
        ]
    }
    assert c.section("governor") == {"quiet_from": "22:00", "budgets": {"daily_usd": 5}}
    assert "watchdog" in c.sections and c.section("watchdog") is None
    assert c.section("fleet") is None
    assert set(c.sections) == {"routes", "governor", "watchdog"}


def test_every_section_name_is_accepted() -> None:
    text = "".join(f"{name}: {{anything: [1, 2]}}\n" for name in sorted(SECTIONS))
    c = parse(text)
    assert set(c.sections) == SECTIONS


def test_lines_cover_the_whole_document() -> None:
    c = parse(SECTIONED)
    assert c.lines["default_gpu"] == 2
    assert c.lines["routes"] == 3
    assert c.lines["routes.summarize"] == 4
    assert c.lines["routes.summarize[0]"] == 5
    assert c.lines["routes.summarize[0].backend"] == 5
    assert c.lines["routes.summarize[0].model"] == 6
    assert c.lines["routes.summarize[0].max_tokens"] == 7
    assert c.lines["routes.summarize[1].model"] == 9
    assert c.lines["governor.quiet_from"] == 11
    assert c.lines["governor.budgets.daily_usd"] == 12
    assert c.lines["watchdog"] == 13


def test_config_error_uses_the_key_line() -> None:
    c = parse(SECTIONED)
    error = c.error("routes.summarize[0].model", "unknown model 'qwen2.5-7b'", hint="see models")
    assert isinstance(error, ConfigError)
    assert str(error) == f"{FILE}:6: routes.summarize[0].model: unknown model 'qwen2.5-7b'"
    assert error.hint == "see models"


def test_config_error_falls_back_to_the_nearest_parent() -> None:
    c = parse(SECTIONED)
    assert c.error("routes.summarize[1].temperature", "required").line == 8
    assert c.error("routes.summarize[7]", "missing").line == 4
    assert c.error("governor.budgets.weekly_usd", "x").line == 12
    assert c.error("fleet.size", "missing").line is None
    assert str(c.error("fleet.size", "missing")) == f"{FILE}: fleet.size: missing"


def test_config_error_without_a_file() -> None:
    assert str(Config().error("routes", "needs a file")) == "routes: needs a file"


def test_merge_keys_are_not_duplicates() -> None:
    c = parse(
        """
        agents:
          base: &base
            gpu: 0
            need: 6GiB
          summarizer:
            <<: *base
            need: 8GiB
        """
    )
    assert c.sections["agents"]["summarizer"] == {"gpu": 0, "need": "8GiB"}
    assert c.lines["agents.summarizer.need"] == 7
    assert c.lines["agents.summarizer.gpu"] == 3  # where the merged value is written


def test_merge_order_earlier_sources_win() -> None:
    c = parse(
        """
        router:
          a: &a {x: 1, y: 1}
          b: &b {x: 2, z: 2}
          c:
            <<: [*a, *b]
        """
    )
    assert c.sections["router"]["c"] == {"x": 1, "y": 1, "z": 2}


def test_bad_merge_is_an_error() -> None:
    assert "'<<' must merge a mapping" in str(fails("router:\n  <<: 3\n"))


@pytest.mark.parametrize("key", ["fleet", "defaults", "residents", "devices"])
def test_a_section_nothing_reads_is_refused_not_silently_ignored(key: str) -> None:
    # A fleet: block belongs in a fleet file, defaults: under router:; none of them would act.
    error = fails(f"{key}:\n  x: 1\n")
    assert (error.line, error.key) == (1, key)
    assert "router" in (error.hint or "") and "watchdog" in (error.hint or "")


def test_the_fleet_file_parses_with_its_own_sections() -> None:
    c = parse_config(
        "fleet: {jitter: 1s}\nagents: []\n", FILE, sections=frozenset({"fleet", "agents"})
    )
    assert set(c.sections) == {"fleet", "agents"}
    assert fails_with("routes: {}\n", frozenset({"fleet", "agents"})).key == "routes"


def fails_with(text: str, sections: frozenset[str]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, FILE, sections=sections)
    return caught.value


def test_exit_wait_is_a_duration_named_with_its_line_when_bad(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "gpulock.yaml"
    path.write_text("exit_wait: 3s\n")
    assert load_config(str(path)).exit_wait_s == 3.0
    path.write_text("reserve: 1GiB\nexit_wait: soon\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "gpulock.yaml:2: exit_wait:" in str(e.value)


@pytest.mark.parametrize(
    ("section", "load"),
    [
        ("serve", "gpulock.serve.config"),
        ("metrics", "gpulock.metrics.config"),
        ("governor", "gpulock.governor.config"),
        ("cluster", "gpulock.cluster.config"),
    ],
)
def test_a_packages_section_is_a_mapping_of_known_keys(
    tmp_path: pathlib.Path, section: str, load: str
) -> None:
    import importlib

    loader = importlib.import_module(load).load
    path = tmp_path / "gpulock.yaml"
    path.write_text(f"reserve: 10%\n{section}:\n  - not a mapping\n")
    with pytest.raises(ConfigError) as info:
        loader(load_config(str(path)))
    assert (info.value.line, info.value.key) == (2, section)
    assert "expected a mapping of settings, got list" in str(info.value)
    path.write_text(f"reserve: 10%\n{section}:\n  no_such_key: 1\n")
    with pytest.raises(ConfigError) as info:
        loader(load_config(str(path)))
    assert (info.value.line, info.value.key) == (3, f"{section}.no_such_key")
    assert "unknown key 'no_such_key'" in str(info.value)
    assert "known keys: " in (info.value.hint or "")
