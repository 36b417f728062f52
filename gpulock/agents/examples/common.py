"""What the example agents share: finding their inputs, placing their outputs, writing files
atomically, and turning whatever a model said into well-formed text.

Models can say anything (the tiny test model says random ASCII), so every agent post-processes
answers deterministically: a label not found is ``unsorted``, tags fall back to the document's
own words, a summary is cleaned into one safe Markdown paragraph.  Nothing here imports the
router: the agents get their models from ``ctx.model()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import stat
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpulock.agents.runtime import Context
from gpulock.agents.spec import AgentError
from gpulock.core.shared import EXAMPLES
from gpulock.core.state import ensure_subdir
from gpulock.core.statefile import atomic_write

__all__ = [
    "NOTE_SUFFIXES",
    "STOPWORDS",
    "Doc",
    "Stash",
    "dedupe",
    "fit",
    "frequent_words",
    "input_files",
    "md_escape_start",
    "models_unloaded",
    "one_line",
    "out_file",
    "out_folder",
    "output_mode",
    "paragraph",
    "read_doc",
    "run_hint",
    "title_of",
    "unique_names",
    "words",
    "write_bytes",
    "write_json",
    "write_text",
]

NOTE_SUFFIXES: Final = (".txt", ".md")
OUT_DIR: Final = "out"
STASH_DIR: Final = "work"
# A note or message bigger than this is not a note: it is left out (and logged), so that a
# stray log file in the folder cannot make a cron run read gigabytes.
MAX_DOC_BYTES: Final = 4 * 1024 * 1024

# Words that say nothing about a text's topic (tags, index terms), mail greetings included.
_STOPWORDS_TEXT: Final = """\
a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from
further had has have having he her here hers him his how i if in into is it its itself just
let like me more most my no nor not now of off on once only or other our ours out over own
same she should so some such than that the their theirs them then there these they this
those through to too under until up very was we were what when where which while who whom
why will with would you your yours yourself re fwd hi hello thanks thank regards please dear
get got one two new via per shall may might must
"""
STOPWORDS: Final = frozenset(_STOPWORDS_TEXT.split())

_WORD_RE: Final = re.compile(r"[a-z][a-z'-]*[a-z]|[a-z]")
_SPACE_RE: Final = re.compile(r"\s+")
_CONTROL_RE: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


# --- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Doc:
    """One input file, read.  ``key`` changes when the file does (path, size, mtime)."""

    path: Path
    key: str
    text: str
    title: str
    size_bytes: int

    @property
    def word_count(self) -> int:
        return len(self.text.split())


def input_files(
    ctx: Context,
    *,
    suffixes: Sequence[str] | None,
    what: str,
    usage: str,
) -> list[Path]:
    """The files named by the agent's INPUTs: files as given, folders by their listing.

    A folder contributes its regular, non-hidden files (with one of ``suffixes``; any file
    when None), not recursively, sorted by name.  No INPUT, or one that does not exist, is an
    AgentError whose hint is ``usage`` (how to run the agent).
    """
    if not ctx.inputs:
        raise AgentError(f"no input given: it needs {what}", hint=usage)
    found: list[Path] = []
    for given in ctx.inputs:
        path = given.expanduser()
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if _wanted(p, suffixes))
        elif path.is_file():
            found.append(path)
        else:
            problem = "no such file or folder" if not path.exists() else "not a file or folder"
            raise AgentError(f"{given}: {problem}", hint=usage)
    # A file named twice (a folder and one of its files) is one item, not two.
    seen: set[Path] = set()
    out = []
    for p in found:
        real = p.absolute()
        if real not in seen:
            seen.add(real)
            out.append(real)
    return out


def _wanted(path: Path, suffixes: Sequence[str] | None) -> bool:
    name = path.name
    if name.startswith(".") or name.endswith("~"):  # hidden files and editors' backups
        return False
    if suffixes is not None and path.suffix.lower() not in suffixes:
        return False
    return path.is_file()


def read_doc(path: Path) -> Doc | None:
    """Read one input as text (undecodable bytes replaced); None when it is too big."""
    st = path.stat()
    if st.st_size > MAX_DOC_BYTES:
        return None
    text = path.read_bytes().decode("utf-8", errors="replace")
    return Doc(
        path=path,
        key=f"{path}|{st.st_size}|{st.st_mtime_ns}",
        text=text,
        title=title_of(text, path),
        size_bytes=st.st_size,
    )


def title_of(text: str, path: Path) -> str:
    """A Markdown heading or a ``Subject:``, else a short first line, else the file's name."""
    for line in text.splitlines()[:20]:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            return one_line(stripped.lstrip("#"), 80) or _from_name(path)
        if stripped.lower().startswith("subject:"):
            return one_line(stripped[len("subject:") :], 80) or _from_name(path)
        if ":" in stripped.split(" ", 1)[0]:
            continue  # a header line (From:, Date:) of a message
        return one_line(stripped, 80) if len(stripped) <= 80 else _from_name(path)
    return _from_name(path)


def _from_name(path: Path) -> str:
    return path.stem.replace("_", " ").replace("-", " ").strip().capitalize() or path.name


def unique_names(paths: Sequence[Path]) -> dict[Path, str]:
    """A file name per path to use in an output folder; a name seen twice gets its path's hash.

    Deterministic for the same list, so a resumed run picks the same names.
    """
    counts = Counter(p.name for p in paths)
    out = {}
    for p in paths:
        if counts[p.name] == 1:
            out[p] = p.name
        else:
            tag = hashlib.sha256(str(p).encode()).hexdigest()[:8]
            out[p] = f"{p.stem}-{tag}{p.suffix}"
    return out


# --- outputs ---------------------------------------------------------------------------------


def out_folder(ctx: Context) -> Path:
    """``--out`` as a folder (created), else ``<state>/agents/<name>/out/``."""
    if ctx.out is not None:
        folder = ctx.out.expanduser()
        if folder.exists() and not folder.is_dir():
            raise AgentError(
                f"--out {ctx.out} is a file; this agent writes a folder of results",
                hint=f"give a folder: --out {ctx.out}.d",
            )
        folder.mkdir(parents=True, exist_ok=True)
        return folder.absolute()
    return ensure_subdir(ctx.agent_dir, OUT_DIR, group=ctx.settings.group)


def out_file(ctx: Context, default_name: str) -> Path:
    """``--out`` as a file (its folder created), else ``<state>/agents/<name>/out/NAME``."""
    if ctx.out is not None:
        path = ctx.out.expanduser()
        if path.is_dir():
            path = path / default_name  # --out ~/reports/ means "in there"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.absolute()
    return out_folder(ctx) / default_name


def output_mode(folder: Path) -> int:
    """The mode of a result written into ``folder``: as private or as shared as the folder.

    0o600 in a folder only its owner may enter (the default ``<state>/agents/NAME/out/``),
    0o660 in a group-writable one (a state folder shared with a group, where another member's
    run appends to the same files), 0o644 elsewhere: results are the user's documents.
    """
    try:
        mode = folder.stat().st_mode
    except OSError:
        return 0o644
    if mode & stat.S_ISVTX:  # /tmp and the like: writable by all, but nobody else's files
        return 0o644
    if mode & stat.S_IWGRP:
        return 0o660
    if not mode & (stat.S_IXGRP | stat.S_IXOTH):
        return 0o600
    return 0o644


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` at once: a reader sees the old file or the new one, never half."""
    atomic_write(path, data, mode=output_mode(path.parent))


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: Path, record: Any) -> None:
    write_text(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")


# --- a checkpointed batch's results ----------------------------------------------------------


class Stash:
    """Per-item results of a checkpointed batch, kept in ``<state>/agents/<name>/work/``.

    ``ctx.batch`` remembers which items are done; their results have to survive the kill as
    well, so that the resumed run can still write the whole output.  An item's result is put
    here before the batch moves on; ``clear()`` once the output is written.
    """

    def __init__(self, ctx: Context) -> None:
        self.folder = ensure_subdir(ctx.agent_dir, STASH_DIR, group=ctx.settings.group)
        self.mode = ctx.settings.file_mode

    def _path(self, key: str) -> Path:
        return self.folder / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def get(self, key: str) -> dict[str, Any] | None:
        """The result stored for ``key``; None when there is none or it is unreadable."""
        try:
            record = json.loads(self._path(key).read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("key") != key:
            return None  # a hash collision or a foreign file: compute it again
        value = record.get("value")
        return value if isinstance(value, dict) else None

    def put(self, key: str, value: dict[str, Any]) -> None:
        data = json.dumps({"key": key, "value": value}, ensure_ascii=False).encode()
        atomic_write(self._path(key), data, mode=self.mode)

    def clear(self) -> None:
        for p in self.folder.glob("*.json"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


# --- models ----------------------------------------------------------------------------------


@contextlib.contextmanager
def models_unloaded(ctx: Context) -> Iterator[None]:
    """Unload the run's models when the block ends, however it ends.

    A llama.cpp model still loaded when the interpreter shuts down prints a traceback from its
    ``__del__`` on stderr, which cron would mail; unloading first keeps a good run silent.
    """
    try:
        yield
    finally:
        ctx.flush()


def fit(text: str, model: Any, *, max_tokens: int | None, overhead: str) -> str:
    """``text`` cut so that ``overhead`` + it + the answer fit the model's context.

    Counts one token per character: byte-level tokenizers (the tiny test model) come close to
    that and real ones use fewer, so it never overflows.  An overflowing prompt would be a
    failed call, and the router cools a failing model down for every agent.
    """
    candidate = model.candidate
    answer = max_tokens if max_tokens is not None else int(candidate.max_tokens)
    room = int(candidate.n_ctx) - answer - len(overhead) - 32  # 32: BOS, chat template
    if room <= 0:
        return ""
    if len(text) <= room:
        return text
    cut = text[:room]
    space = cut.rfind(" ")
    return cut[:space] if space > room // 2 else cut


# --- text ------------------------------------------------------------------------------------


def one_line(text: str, limit: int) -> str:
    """``text`` on one line: control characters dropped, whitespace collapsed, at most
    ``limit`` characters (cut at a word, with an ellipsis)."""
    flat = _SPACE_RE.sub(" ", _CONTROL_RE.sub(" ", text)).strip()
    if len(flat) <= limit:
        return flat
    cut = flat[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:-") + "…"


def md_escape_start(line: str) -> str:
    """Escape a character that would make a Markdown line a heading, quote, list or fence."""
    if line[:1] in ("#", ">", "-", "+", "*", "=", "|", "`", "~") or re.match(r"\d+[.)]", line):
        return "\\" + line
    return line


def paragraph(text: str, limit: int = 700, *, label: str | None = None) -> str:
    """A model's answer as one Markdown paragraph: one line, a leading ``label:`` dropped,
    HTML neutralised, never taken for a heading or a code fence."""
    line = one_line(text, limit)
    if label and line.lower().startswith(label.lower() + ":"):
        line = line[len(label) + 1 :].lstrip()
    line = line.replace("<", "&lt;")
    return md_escape_start(line)


def words(text: str) -> list[str]:
    """Lower-case words of ``text`` (letters, inner hyphens and apostrophes)."""
    return _WORD_RE.findall(text.lower())


def frequent_words(text: str, limit: int) -> list[str]:
    """The ``limit`` most frequent words of ``text`` that say something (3+ letters, no
    stop words); ties go alphabetically, so the answer is the same on every run."""
    counts = Counter(w.strip("'") for w in words(text))
    ranked = sorted(
        (w for w in counts if len(w) >= 3 and w not in STOPWORDS and "'" not in w),
        key=lambda w: (-counts[w], w),
    )
    return ranked[:limit]


def dedupe(items: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def run_hint(name: str, args: str) -> str:
    """A hint: how to run the agent, and where the sample inputs are (they ship with gpulock)."""
    text = f"gpulock agent run {name} {args}"
    data = EXAMPLES / "data"
    if data.is_dir():
        text += f" (sample inputs: {data})"
    return text
