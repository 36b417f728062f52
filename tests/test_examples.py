"""The example agents (``gpulock/agents/examples/``), run as cron runs them: ``python -m
gpulock.agents run``.

Every run is a real process with a private state folder and a config whose routes send each
task to the tiny llama.cpp model (``gpulock.router.tiny_model``): what it says is random ASCII, but
every call is a real llama.cpp call through the router, so these tests check what the agents
make of any answer (well-formed files), the accounting (``call`` and ``agent`` events), the GPU
lock (``acquire`` events, a skip when the GPU is held) and resuming after a kill.  The sample
inputs are the ones shipped in ``examples/data/``.  The pure post-processing is table-tested.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from procs import World, wait_until

from gpulock.agents import checkpoint
from gpulock.agents.examples.common import output_mode, paragraph
from gpulock.agents.examples.inbox_triage import LABELS, label_of
from gpulock.agents.examples.report_drafter import LineGuard, headings_from
from gpulock.agents.examples.tagger import normalise_tags, tags_for
from gpulock.agents.examples.tts_batch import CHAR_FRAMES, RATE_HZ, spoken_text, stressed, tone_hz
from gpulock.core import events
from gpulock.core.config import parse_config
from gpulock.router.tiny_model import ensure_tiny_llama

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "data"
SAMPLE_CONFIG = REPO / "examples" / "gpulock.yaml"
AGENTS = (sys.executable, "-m", "gpulock.agents")
GPULOCK = (sys.executable, "-m", "gpulock")
RUN_S = 30.0
GIB = 1024**3

EXAMPLES = {  # name: (task, schedule)
    "digest": ("summarize", "*/30 * * * *"),
    "inbox-triage": ("classify", "*/10 * * * *"),
    "tagger": ("tag", "0 * * * *"),
    "report-drafter": ("draft", "30 7 * * mon-fri"),
    "tts-batch": ("speech", "0 2 * * *"),
    "embed-index": (None, "15 * * * *"),
}


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_llama(tmp_path_factory.mktemp("tiny"))


def configure(world: World, tiny: Path, *, summarize_tokens: int = 16) -> None:
    """Routes for every example task to the tiny model: the cpu tier, but ``draft`` on the gpu
    tier of a simulated 24 GiB GPU (so the lock and the resident path run)."""
    model = f"{{backend: llama_cpp, model: {tiny}"
    world.config.write_text(
        "simulate: 24GiB\n"
        "router:\n"
        # One thread: on a busy 2-core machine llama.cpp's threads would wait for each other.
        "  defaults: {n_ctx: 512, max_tokens: 16, n_threads: 1}\n"
        "routes:\n"
        f"  summarize: [{model}, tier: cpu, max_tokens: {summarize_tokens}}}]\n"
        f"  classify: [{model}, tier: cpu}}]\n"
        f"  tag: [{model}, tier: cpu}}]\n"
        f"  draft: [{model}, tier: gpu, vram: 1GiB, min_vram: 2GiB, max_tokens: 24}}]\n"
    )


@dataclass
class Ran:
    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"{' '.join(self.args)} -> exit {self.code}\n"
            f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr}"
        )


def run(world: World, *args: str, argv0: tuple[str, ...] = AGENTS) -> Ran:
    """``python -m gpulock.agents ARGS`` in the world's state folder and config, to completion."""
    argv = (*argv0, *args)
    p = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=world.root,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{' '.join(argv)} still running after {RUN_S:g} s: killed") from None
    return Ran(argv, p.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def run_ok(world: World, *args: str) -> Ran:
    r = run(world, "run", *args)
    # Exit 0 and nothing at all on stderr: under cron any output is mailed to someone.
    assert (r.code, r.stderr) == (0, ""), r.describe()
    return r


def events_of(world: World, kind: str, **match: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in events.read(world.state)
        if e.get("event") == kind and all(e.get(k) == v for k, v in match.items())
    ]


def assert_agent_ok(world: World, name: str, runs: int = 1) -> None:
    ends = events_of(world, "agent", agent=name)
    assert [e["outcome"] for e in ends] == ["ok"] * runs, ends


def calls_of(world: World, name: str, task: str) -> list[dict[str, Any]]:
    calls = events_of(world, "call", agent=name)
    assert calls, f"no call events for {name}"
    for c in calls:
        assert (c["task"], c["ok"], c["model"]) == (task, True, "tiny-llama"), c
    return calls


def sections(markdown: str) -> list[tuple[str, list[str]]]:
    """``## heading`` sections of a Markdown file: (heading, non-empty body lines)."""
    out: list[tuple[str, list[str]]] = []
    for line in markdown.splitlines():
        if line.startswith("## "):
            out.append((line[3:], []))
        elif out and line.strip():
            out[-1][1].append(line)
    return out


# --- the sample config and the listing -------------------------------------------------------


def test_sample_config_parses_and_routes_every_example_task() -> None:
    from gpulock.governor import config as governor_config
    from gpulock.router.routes import load_table

    cfg = parse_config(SAMPLE_CONFIG.read_text(), str(SAMPLE_CONFIG))
    table = load_table(cfg)
    governor_config.load(cfg)  # the watchdog: section is valid too
    tasks = {t for t, _ in EXAMPLES.values() if t}
    assert tasks <= set(table.tasks)
    tiers = {c.tier for cands in table.tasks.values() for c in cands}
    assert tiers == {"gpu", "cpu", "cloud"}
    gpu = [c for c in table.tasks["summarize"] if c.tier == "gpu"]
    assert gpu and gpu[0].min_vram_bytes is not None and gpu[0].model.endswith(".gguf")
    cloud = [c for cands in table.tasks.values() for c in cands if c.tier == "cloud"]
    assert cloud and all(c.api_key_env == "OPENAI_API_KEY" for c in cloud)
    home = str(Path("~").expanduser())
    local = [c for cands in table.tasks.values() for c in cands if c.local]
    assert all(c.model.startswith(home + "/models/") for c in local), local


def test_agent_list_json_lists_every_example_with_its_schedule(world: World) -> None:
    r = run(world, "agent", "list", "--json", argv0=GPULOCK)
    assert r.code == 0, r.describe()
    listed = {a["name"]: a for a in json.loads(r.stdout)["agents"]}
    assert EXAMPLES.keys() <= listed.keys()
    for name, (task, schedule) in EXAMPLES.items():
        a = listed[name]
        assert (a["task"], a["schedule"]) == (task, schedule), a
        assert a["module"].startswith("gpulock.agents.examples.") and a["description"], a
        assert a["timeout_s"] is not None, a
    tts = listed["tts-batch"]
    assert (tts["need_bytes"], tts["flush_every"]) == (12 * GIB, 25)


# --- each agent, end to end ------------------------------------------------------------------


def test_digest_writes_a_section_per_note(world: World, tiny: Path) -> None:
    configure(world, tiny)
    notes = sorted(DATA.joinpath("notes").iterdir())
    out = world.root / "digest.md"
    run_ok(world, "digest", str(DATA / "notes"), "--out", str(out))
    found = sections(out.read_text())
    assert len(found) == len(notes) == 6
    for (heading, body), note in zip(found, notes, strict=True):
        text = note.read_text()
        assert heading == text.splitlines()[0].lstrip("# ").strip()
        meta, summary = body
        assert meta.startswith(f"`{note.name}` · {len(text.split())} words · ")
        assert "cpu model `tiny-llama`" in meta
        assert summary.strip() and not summary.startswith(("#", "```"))
    assert len(calls_of(world, "digest", "summarize")) == 6
    assert_agent_ok(world, "digest")
    folder = world.state / "agents" / "digest"
    assert not (folder / "checkpoint.json").exists()
    assert list((folder / "work").iterdir()) == []  # the per-note results are cleared


def test_digest_killed_half_way_resumes_with_the_notes_not_done(world: World, tiny: Path) -> None:
    configure(world, tiny, summarize_tokens=64)  # slower calls: time to kill it half-way
    notes = world.root / "notes"
    notes.mkdir()
    total = 24
    for i in range(total):
        notes.joinpath(f"note-{i:02d}.txt").write_text(f"Note {i}\n\n" + "word " * (20 + i))
    out = world.root / "digest.md"
    with open(world.root / "first.stderr", "wb") as err:
        first = subprocess.Popen(
            [*AGENTS, "run", "digest", str(notes), "--out", str(out)],
            stdin=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    path = world.state / "agents" / "digest" / "checkpoint.json"

    def some_done() -> bool:
        if first.poll() is not None:
            raise AssertionError(f"the run ended (exit {first.returncode}) before the kill")
        try:
            found = checkpoint.load(path)
        except checkpoint.CheckpointError:
            return False  # not there yet
        return found is not None and len(found.done) >= 2

    try:
        wait_until(some_done, RUN_S, "the digest to finish two notes")
        first.send_signal(signal.SIGTERM)
        assert first.wait(RUN_S) == 128 + signal.SIGTERM
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    kept = checkpoint.load(path)
    assert kept is not None and 2 <= len(kept.done) < total
    assert not out.exists()  # no half digest
    calls_before = len(calls_of(world, "digest", "summarize"))

    run_ok(world, "digest", str(notes), "--out", str(out))
    resumed_calls = len(calls_of(world, "digest", "summarize")) - calls_before
    # The note being summarised when the kill came may have its result stashed already.
    assert total - len(kept.done) - 1 <= resumed_calls <= total - len(kept.done)
    headings = [h for h, _ in sections(out.read_text())]
    assert headings == [f"Note {i}" for i in range(total)]
    ends = events_of(world, "agent", agent="digest")
    assert [e["outcome"] for e in ends] == ["killed", "ok"]


def test_inbox_triage_files_every_message_under_one_label_once(world: World, tiny: Path) -> None:
    configure(world, tiny)
    inbox = world.root / "inbox"
    inbox.mkdir()
    for p in DATA.joinpath("inbox").iterdir():
        inbox.joinpath(p.name).write_bytes(p.read_bytes())
    out = world.root / "sorted"
    run_ok(world, "inbox-triage", str(inbox), "--out", str(out))

    def check(expected: int) -> None:
        records = [json.loads(line) for line in (out / "triage.jsonl").read_text().splitlines()]
        assert len(records) == expected
        latest = {r["name"]: r for r in records}  # a message triaged again: its last record
        assert sorted(latest) == sorted(p.name for p in inbox.iterdir())
        for r in records:
            assert r["label"] in (*LABELS, "unsorted"), r
            assert (r["tier"], r["model"]) == ("cpu", "tiny-llama"), r
            assert r["file"] == str(inbox / r["name"])
            assert label_of(r["answer"]) == r["label"], r
        for message in inbox.iterdir():
            copies = list(out.glob(f"*/{message.name}"))
            assert len(copies) == 1, copies  # one message, one folder
            assert copies[0].read_bytes() == message.read_bytes()
            assert copies[0].parent.name == latest[message.name]["label"]

    check(8)
    assert len(calls_of(world, "inbox-triage", "classify")) == 8
    # The next run asks only about new mail, and mail edited since.
    inbox.joinpath("009-new.txt").write_text("From: a@b.example\nSubject: lunch?\n\nNoon?\n")
    with inbox.joinpath("002-sprint.txt").open("a") as f:
        f.write("\nPS: the room changed.\n")
    run_ok(world, "inbox-triage", str(inbox), "--out", str(out))
    check(10)
    assert len(calls_of(world, "inbox-triage", "classify")) == 10
    assert_agent_ok(world, "inbox-triage", runs=2)


def test_tagger_writes_sidecars_of_at_most_five_clean_tags(world: World, tiny: Path) -> None:
    configure(world, tiny)
    docs = sorted(DATA.joinpath("notes").iterdir())
    out = world.root / "tags"
    run_ok(world, "tagger", str(DATA / "notes"), "--out", str(out))
    index = json.loads((out / "tags.json").read_text())
    assert index["format"] == "gpulock.tags-index/1"
    assert sorted(index["docs"]) == [d.name for d in docs]
    for doc in docs:
        record = json.loads((out / f"{doc.name}.tags.json").read_text())
        tags = record["tags"]
        assert record["format"] == "gpulock.tags/1" and record["file"] == str(doc)
        assert 1 <= len(tags) <= 5 and len(set(tags)) == len(tags), record
        assert all(re.fullmatch(r"[a-z][a-z-]*[a-z]", t) for t in tags), record
        assert record["source"] in ("model", "words")
        assert (record["tier"], record["model"]) == ("cpu", "tiny-llama")
        assert index["docs"][doc.name] == tags
    assert len(calls_of(world, "tagger", "tag")) == len(docs)
    assert_agent_ok(world, "tagger")


def test_report_drafter_streams_sections_on_the_gpu_tier(world: World, tiny: Path) -> None:
    configure(world, tiny)
    notes = sorted(DATA.joinpath("report-notes").iterdir())
    out = world.root / "report.md"
    run_ok(world, "report-drafter", str(DATA / "report-notes"), "--out", str(out))
    text = out.read_text()
    assert text.startswith("# Report: report notes\n")
    found = sections(text)
    *drafted, (last, sources) = found
    assert 3 <= len(drafted) <= 5
    assert all(body for _, body in drafted), found
    assert last == "Sources" and len(sources) == len(notes)
    assert not out.with_name("report.md.part").exists()
    calls = calls_of(world, "report-drafter", "draft")
    assert len(calls) == 1 + len(drafted)  # the outline, then one streamed call per section
    assert {c["tier"] for c in calls} == {"gpu"}
    grants = events_of(world, "acquire")
    assert grants and all(g["name"].startswith("report-drafter") for g in grants), grants
    assert_agent_ok(world, "report-drafter")


@pytest.mark.parametrize(
    ("agent", "inputs", "planted"),
    [
        ("inbox-triage", "inbox", "triage.jsonl"),  # appended to, run after run
        ("report-drafter", "report-notes", "report.md.part"),  # the draft before its rename
    ],
)
def test_a_planted_symlink_is_never_written_through(
    world: World, tiny: Path, agent: str, inputs: str, planted: str
) -> None:
    configure(world, tiny)
    victim = world.root / "victim.txt"
    victim.write_text("keep me\n")
    out = world.root / "out"
    out.mkdir()
    (out / planted).symlink_to(victim)
    target = out if agent == "inbox-triage" else out / "report.md"
    r = run(world, "run", agent, str(DATA / inputs), "--out", str(target))
    assert r.code == 1, r.describe()
    assert "Traceback" not in r.stderr, r.describe()
    assert victim.read_text() == "keep me\n"


def test_tts_batch_writes_wavs_of_the_right_length_under_the_lock(world: World) -> None:
    world.config.write_text("simulate: 24GiB\n")
    source = DATA / "speech" / "lines.txt"
    out = world.root / "speech"
    run_ok(world, "tts-batch", str(source), "--out", str(out))
    lines = [(i, ln) for i, ln in enumerate(source.read_text().splitlines(), 1) if ln.strip()]
    assert sorted(p.name for p in out.iterdir()) == [f"lines-{i:03d}.wav" for i, _ in lines]
    for i, line in lines:
        with wave.open(str(out / f"lines-{i:03d}.wav"), "rb") as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
            chars = len(" ".join(line.split()))
            assert w.getnframes() / w.getframerate() == pytest.approx(0.05 * chars)
            assert any(w.readframes(w.getnframes())), "silence"
    grants = events_of(world, "acquire", name="tts-batch")
    assert [g["need_bytes"] for g in grants] == [12 * GIB] * math.ceil(len(lines) / 8)
    assert_agent_ok(world, "tts-batch")


def test_tts_batch_asks_the_routers_speech_model_for_each_line_inside_its_hold(
    world: World, tiny: Path
) -> None:
    configure(world, tiny)
    with world.config.open("a") as f:  # the "voice" runs on the gpu tier, inside the batch's hold
        f.write(f"  speech: [{{backend: llama_cpp, model: {tiny}, tier: gpu, vram: 1GiB}}]\n")
    source = DATA / "speech" / "lines.txt"
    out = world.root / "speech"
    run_ok(world, "tts-batch", str(source), "--out", str(out))
    lines = [ln for ln in source.read_text().splitlines() if ln.strip()]
    calls = events_of(world, "call", agent="tts-batch")
    assert len(calls) == len(lines) and all(c["tier"] == "gpu" and c["ok"] for c in calls)
    # The router's calls share the batch's hold (re-entrant): one grant per chunk, 12 GiB each.
    grants = events_of(world, "acquire", name="tts-batch")
    assert [g["need_bytes"] for g in grants] == [12 * GIB] * math.ceil(len(lines) / 8)
    assert len(list(out.glob("*.wav"))) == len(lines)
    assert_agent_ok(world, "tts-batch")


@pytest.mark.parametrize(
    ("line", "answer", "word"),
    [
        ("Good morning, Lisbon!", "lisbon", "Lisbon!"),
        ("Good morning, Lisbon!", "The word is: MORNING.", "morning,"),
        ("Good morning, Lisbon!", "x8#q zz", None),
        ("", "anything", None),
    ],
)
def test_stress_falls_on_the_first_word_of_the_line_the_answer_names(
    line: str, answer: str, word: str | None
) -> None:
    r = stressed(line, answer)
    assert (line[r.start : r.stop] if r else None) == word


def test_tts_batch_skips_with_75_while_the_gpu_is_held_elsewhere(world: World) -> None:
    world.config.write_text("simulate: 24GiB\n")
    holder = world.hold("holder")  # the whole GPU, until released
    out = world.root / "speech"
    r = run(world, "run", "tts-batch", str(DATA / "speech"), "--out", str(out), "--timeout", "1s")
    # 75 while the holder still holds: it gave up at its timeout instead of waiting its turn.
    assert (r.code, r.stdout, r.stderr) == (75, "", ""), r.describe()
    assert not any(out.glob("*.wav"))
    (end,) = events_of(world, "agent", agent="tts-batch")
    assert end["outcome"] == "skip" and "busy" in end["reason"], end
    holder.release()


def test_embed_index_counts_words_per_document(world: World) -> None:
    docs = sorted(DATA.joinpath("notes").iterdir())
    out = world.root / "index.json"
    run_ok(world, "embed-index", str(DATA / "notes"), "--out", str(out))
    index = json.loads(out.read_text())
    assert index["format"] == "gpulock.bow-index/1"
    assert [d["file"] for d in index["docs"]] == [str(d) for d in docs]
    df: dict[str, int] = {}
    for entry, doc in zip(index["docs"], docs, strict=True):
        assert entry["words"] == len(doc.read_text().split())
        assert 1 <= len(entry["top"]) <= 5 and set(entry["top"]) <= set(entry["counts"])
        for word in entry["counts"]:
            df[word] = df.get(word, 0) + 1
    assert index["df"] == df
    assert index["docs"][0]["counts"]["test"] == 2  # "flaky integration test", "the test"
    assert_agent_ok(world, "embed-index")


@pytest.mark.parametrize(
    ("agent", "args", "message", "hint"),
    [
        ("digest", [], "no input given", "gpulock agent run digest "),
        ("digest", ["no-such-folder"], "no-such-folder: no such file or folder", "gpulock "),
        ("tagger", [str(DATA / "notes"), "--out", str(SAMPLE_CONFIG)], "is a file", "give "),
    ],
)
def test_bad_input_is_one_error_and_a_hint_never_a_traceback(
    world: World, agent: str, args: list[str], message: str, hint: str
) -> None:
    r = run(world, "run", agent, *args)
    assert r.code == 1, r.describe()
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: "), r.describe()
    assert message in lines[0] and lines[1].startswith("hint: " + hint), r.describe()
    (end,) = events_of(world, "agent", agent=agent)
    assert end["outcome"] == "error"


# --- the post-processing, pure ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("billing", "billing"),
        ("  Spam.", "spam"),
        ("This is WORK, not personal", "work"),
        ("personal or work", "personal"),
        ("newsletters", "unsorted"),  # a whole word only
        ("homework", "unsorted"),
        ('Qs" h6XI', "unsorted"),
        ("", "unsorted"),
    ],
)
def test_label_is_the_first_label_word_in_the_answer(answer: str, label: str) -> None:
    assert label_of(answer) == label


@pytest.mark.parametrize(
    ("answer", "tags"),
    [
        ("Budget, cloud-spend, GPU, Budget, hw", ["budget", "cloud-spend", "gpu"]),
        ("the a of, and", []),
        ("1. travel\n2. lisbon\n3. food\n4. tiles\n5. trams\n6. sintra", None),
        ('Qs" h6XIOINfoso]gqO_C JT_', ["xioinfoso", "gqo"]),
        ("zzz, bcd, --, x", []),
    ],
)
def test_tags_are_normalised_words_of_the_answer(answer: str, tags: list[str] | None) -> None:
    expected = ["travel", "lisbon", "food", "tiles", "trams"] if tags is None else tags
    assert normalise_tags(answer) == expected


def test_tags_fall_back_to_the_most_frequent_words() -> None:
    text = "Gpu queue wait. The queue is long; the GPU is shared. Queue again, wait."
    assert tags_for("!!! ###", text) == (["queue", "gpu", "wait", "long", "shared"], "words")
    assert tags_for("cats", text) == (["cats"], "model")


def test_headings_are_cleaned_and_topped_up_from_the_notes() -> None:
    answer = "1. **Incidents**\n- Changes made\n# Numbers:\n\nx\nIncidents\n"
    assert headings_from(answer, ["Other"]) == ["Incidents", "Changes made", "Numbers"]
    assert headings_from('U "sLoXX I', ["Changes", "Incidents", "Next"]) == [
        'U "sLoXX I',
        "Changes",
        "Incidents",
    ]
    many = "\n".join(f"Part {c}" for c in "abcdefg")
    assert len(headings_from(many, [])) == 5


def test_streamed_text_cannot_open_a_heading_or_a_fence() -> None:
    guard = LineGuard()
    pieces = ["Intro ## not", " a heading\n", "  #", "# Title\n```", "py\nok"]
    assert "".join(guard.feed(p) for p in pieces) == (
        "Intro ## not a heading\n  \\## Title\n\\```py\nok"
    )


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Summary:  The  note\nsays\thello.", "The note says hello."),
        ("# big", "\\# big"),
        ("```code", "\\```code"),
        ("1. first", "\\1. first"),
        ("a <script>", "a &lt;script>"),
    ],
)
def test_a_summary_is_one_safe_markdown_paragraph(answer: str, expected: str) -> None:
    assert paragraph(answer, 100, label="summary") == expected


def test_speech_is_deterministic_and_silent_between_words() -> None:
    assert spoken_text("  Hello,\tworld  ") == "Hello, world"
    assert tone_hz(" ") is None and tone_hz(",") is None
    assert tone_hz("a") == pytest.approx(220.0) and tone_hz("A") == tone_hz("a")
    tones = [tone_hz(c) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    assert len(set(tones)) == len(tones) and max(t or 0 for t in tones) < RATE_HZ / 2
    assert CHAR_FRAMES == 800


@pytest.mark.parametrize(
    ("folder_mode", "file_mode"),
    [(0o700, 0o600), (0o2770, 0o660), (0o755, 0o644), (0o1777, 0o644)],
)
def test_a_result_is_as_private_as_its_folder(
    tmp_path: Path, folder_mode: int, file_mode: int
) -> None:
    tmp_path.chmod(folder_mode)
    assert output_mode(tmp_path) == file_mode
