"""The tour's first GPU job: a digest of a folder of notes (stdlib only, no model).

    gpulock run -- python examples/make_digest.py examples/data/notes

It stands in for a script that loads a model and summarises: it says which GPU gpulock gave
it (``CUDA_VISIBLE_DEVICES``), takes about a second, as a model would (``--seconds 20``: long
enough to see it hold the GPU in ``gpulock status``), and prints the first line of every note.
``--out FILE`` writes the digest there instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description="a digest of a folder of notes")
    p.add_argument("notes", type=Path, help="a folder of .txt and .md notes")
    p.add_argument("--out", type=Path, help="write the digest here (default: stdout)")
    p.add_argument("--seconds", type=float, default=1.0, help="the model's pretend time")
    args = p.parse_args()
    if not args.notes.is_dir():
        print(f"error: {args.notes}: not a folder of notes", file=sys.stderr)
        return 2
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "none")
    print(f"make_digest: on GPU {gpu}", file=sys.stderr)
    time.sleep(args.seconds)  # the model's work
    lines = ["# Digest", ""]
    for note in sorted(args.notes.iterdir()):
        if note.suffix in (".txt", ".md"):
            first = next((ln for ln in note.read_text().splitlines() if ln.strip()), "")
            lines.append(f"- {note.name}: {first.lstrip('# ').strip()}")
    text = "\n".join(lines) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
