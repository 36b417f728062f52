"""``tts-batch``: a GPU batch job in the shape of text-to-speech: lines of text in, WAV files out.

::

    gpulock agent run tts-batch ~/scripts/lines.txt --out ~/speech

Every non-empty line of the ``*.txt`` files given (or found in the folders given) becomes
``<out>/<file stem>-<line number>.wav``: 16 kHz, mono, 16-bit, ``CHAR_S`` seconds per
character of the line (whitespace collapsed), a short tone per letter or digit and silence for
the rest.  The router's model for the ``speech`` task marks, per line, the word that carries
the stress (the first word of the line that its answer names); that word is voiced louder.
Without a ``speech`` route the lines are spoken flat, with one warning in the log.  The rest is
the shape of a real TTS job: it declares ``need="12GiB"``, works in chunks of ``CHUNK_LINES``
lines, holds the GPU (``with ctx.gpu():``) for one chunk at a time so that other agents get a
turn between chunks (the router's calls inside it share that hold), checkpoints every chunk,
and drops its voice cache every ``flush_every`` chunks.  When the GPU cannot be had before the
timeout the run is a skip (exit 75) and cron tries again.  ``--out`` defaults to
``<state>/agents/tts-batch/out/``.
"""

from __future__ import annotations

import io
import math
import sys
import wave
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gpulock.agents.examples.common import input_files, one_line, out_folder, run_hint, write_bytes
from gpulock.agents.runtime import Context
from gpulock.agents.spec import agent

NAME: Final = "tts-batch"
RATE_HZ: Final = 16_000
CHAR_S: Final = 0.05
CHAR_FRAMES: Final = round(RATE_HZ * CHAR_S)  # 800: every character lasts exactly this long
FADE_FRAMES: Final = 80  # 5 ms in and out of each tone: no clicks between characters
AMPLITUDE: Final = 0.3 * 32767
MAX_LINE_CHARS: Final = 400  # 20 s of audio: a longer line is cut, with an ellipsis
CHUNK_LINES: Final = 8
# Letters and digits walk up a pentatonic scale, half an octave higher every five characters,
# from 220 Hz to about 2.5 kHz: neighbours in the alphabet sound different, none clash.
_PENTATONIC: Final = (0, 2, 4, 7, 9)


@dataclass(frozen=True, slots=True)
class Line:
    source: Path
    number: int  # 1-based, as editors show it
    text: str

    @property
    def wav_name(self) -> str:
        return f"{self.source.stem}-{self.number:03d}.wav"


@dataclass(frozen=True, slots=True)
class Chunk:
    key: str
    lines: tuple[Line, ...]


def tone_hz(ch: str) -> float | None:
    """The tone of one character; None for silence (spaces, punctuation)."""
    c = ch.lower()
    if "a" <= c <= "z":
        i = ord(c) - ord("a")
    elif "0" <= c <= "9":
        i = 26 + ord(c) - ord("0")
    elif c.isalpha():
        i = ord(c) % 36  # other scripts' letters: a tone too, not silence
    else:
        return None
    octave, step = divmod(i, len(_PENTATONIC))
    return 220.0 * 2 ** ((6 * octave + _PENTATONIC[step]) / 12)


def samples_of(ch: str) -> array[int]:
    """``CHAR_FRAMES`` 16-bit samples for one character (pure: the same on every call)."""
    hz = tone_hz(ch)
    if hz is None:
        return array("h", bytes(2 * CHAR_FRAMES))
    out = array("h")
    for n in range(CHAR_FRAMES):
        fade = min(1.0, n / FADE_FRAMES, (CHAR_FRAMES - 1 - n) / FADE_FRAMES)
        out.append(int(AMPLITUDE * fade * math.sin(2 * math.pi * hz * n / RATE_HZ)))
    return out


def spoken_text(line: str) -> str:
    """What is "said" for a line: one line, whitespace collapsed, at most MAX_LINE_CHARS."""
    return one_line(line, MAX_LINE_CHARS)


class Voice:
    """Samples per character, computed once each: the "model" this job keeps warm."""

    def __init__(self) -> None:
        self._cache: dict[str, array[int]] = {}

    def clear(self) -> None:
        self._cache.clear()

    def wav(self, text: str, stress: range = range(0)) -> bytes:
        """The line's audio; the characters in ``stress`` at full volume, the rest softer."""
        frames = array("h")
        for i, ch in enumerate(text):
            s = self._cache.get(ch)
            if s is None:
                s = self._cache[ch] = samples_of(ch)
            frames.extend(s if i in stress else array("h", (x * 3 // 5 for x in s)))
        return _wav_bytes(frames)


def stressed(line: str, answer: str) -> range:
    """Where the stressed word is in ``line``: the first word of the line the answer names
    (case and punctuation ignored); an empty range when it names none."""
    named = {w.strip(".,;:!?\"'()").lower() for w in answer.split()}
    pos = 0
    for word in line.split(" "):
        if word and word.strip(".,;:!?\"'()").lower() in named:
            return range(pos, pos + len(word))
        pos += len(word) + 1
    return range(0)


def _wav_bytes(frames: array[int]) -> bytes:
    if sys.byteorder == "big":  # WAV is little-endian
        frames = array("h", frames)
        frames.byteswap()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE_HZ)
        w.writeframes(frames.tobytes())
    return buf.getvalue()


def chunks_of(paths: list[Path]) -> list[Chunk]:
    """The lines to say, in chunks of CHUNK_LINES lines of one file.

    A chunk's key names its file, the file's size and mtime and its lines: an edited file is
    said again, one left alone is not said twice by a resumed run.
    """
    out = []
    for p in paths:
        st = p.stat()
        text = p.read_bytes().decode("utf-8", errors="replace")
        lines = [
            Line(p, i, spoken_text(raw))
            for i, raw in enumerate(text.splitlines(), 1)
            if spoken_text(raw)
        ]
        for start in range(0, len(lines), CHUNK_LINES):
            part = tuple(lines[start : start + CHUNK_LINES])
            key = f"{p}|{st.st_size}|{st.st_mtime_ns}#{part[0].number}-{part[-1].number}"
            out.append(Chunk(key, part))
    return out


@agent(NAME, task="speech", schedule="0 2 * * *", timeout="30m", need="12GiB", flush_every=25)
def tts_batch(ctx: Context) -> None:
    """Turn lines of text into WAV files, a GPU-sized chunk at a time (need 12 GiB)."""
    paths = input_files(
        ctx,
        suffixes=(".txt",),
        what="text files (or folders of *.txt) whose lines to speak",
        usage=run_hint(NAME, "~/scripts/lines.txt --out ~/speech"),
    )
    out = out_folder(ctx)
    chunks = chunks_of(paths)
    voice = Voice()
    ctx.on_flush(voice.clear)  # every flush_every chunks: as a TTS job drops its model's cache
    said = 0
    model = _speech_model(ctx)
    for chunk in ctx.batch(chunks, key=lambda c: c.key):
        with ctx.gpu():  # one chunk per hold: the queue moves between chunks
            for line in chunk.lines:
                stress = range(0)
                if model is not None:
                    answer = model.complete(STRESS_PROMPT.format(line=line.text), max_tokens=8)
                    stress = stressed(line.text, answer)
                write_bytes(out / line.wav_name, voice.wav(line.text, stress))
                said += 1
    ctx.log.info(
        f"wrote {said} WAV files", extra={"out": str(out), "files": said, "chunks": len(chunks)}
    )


STRESS_PROMPT: Final = "Which one word of this line carries the stress?\n\n{line}\n\nWord:"


def _speech_model(ctx: Context) -> Any:
    """The router's model for ``speech``, or None (flat voice) when no route names the task."""
    try:
        return ctx.model()
    except Exception as e:
        if type(e).__name__ != "UnknownTask":
            raise  # NoModelAvailable and the rest: the runtime makes them a skip or an error
        ctx.log.warning(
            "no route for task 'speech': speaking without stress",
            extra={"hint": getattr(e, "hint", None)},
        )
        return None
