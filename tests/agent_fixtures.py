"""Agents for tests/test_agents_runtime.py, loaded by the runtime with ``--module <this file>``.

Each one does something the test can see in files: its output file, a "blocked" file that says
it reached a known point (where the test kills it), a "release" file it waits for.  The waits
here are the agents' own (they stand for real work); the tests wait on files with deadlines.
"""

from __future__ import annotations

import time
from pathlib import Path

from gpulock.agents import Context, agent

LIMIT_S = 30.0  # nothing outlives a crashed test for long


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


@agent("t-hello", description="says hello to its arguments")
def hello(ctx: Context) -> None:
    assert ctx.out is not None
    ctx.out.write_text("hello " + " ".join(ctx.args))
    # "name" clashes with a LogRecord attribute: ctx.log takes it all the same.
    extra = {"n": len(ctx.args), "first": str(ctx.inputs[0]), "name": "clash"}
    ctx.log.info("said hello", extra=extra)


@agent("t-wait", schedule="*/5 * * * *")
def wait(ctx: Context) -> None:
    """Creates INPUT 1, then waits for INPUT 2 to appear."""
    ready, release = ctx.inputs
    ready.touch()
    _wait_for(release)


@agent("t-gpu", timeout="1s", need="1GiB")
def gpu(ctx: Context) -> None:
    assert ctx.out is not None
    with ctx.gpu():
        ctx.out.write_text("had the GPU")


@agent("t-items", task="summarize")
def items(ctx: Context) -> None:
    """ARGS: N [K]: appends 'item i' to --out for i < N; at item K it blocks for good."""
    assert ctx.out is not None
    count = int(ctx.args[0])
    block_at = ctx.args[1] if len(ctx.args) > 1 else None
    for item in ctx.batch([str(i) for i in range(count)]):
        if item == block_at:
            blocked = ctx.out.with_name(ctx.out.name + ".blocked")
            blocked.touch()
            _wait_for(ctx.out.with_name("never"))
        _append(ctx.out, f"item {item}")


@agent("t-flush", flush_every=3)
def flush(ctx: Context) -> None:
    """ARGS: N: appends 'item i' for each item and 'flush' at each flush."""
    assert ctx.out is not None
    out = ctx.out
    ctx.on_flush(lambda: _append(out, "flush"))
    for item in ctx.batch(range(int(ctx.args[0])), key=lambda i: f"k{i}"):
        _append(out, f"item {item}")


@agent("t-model", task="summarize", flush_every=2, timeout="60s")
def model(ctx: Context) -> None:
    """ARGS: N: one completion per item from the router's model, unloaded every 2 items."""
    assert ctx.out is not None
    handle = ctx.model()
    for item in ctx.batch(range(int(ctx.args[0]))):
        text = handle.complete(f"item {item}", max_tokens=4)
        _append(ctx.out, f"{item} {len(text) > 0}")
    assert ctx.model() is handle  # one Model per task and run, reloaded after each flush


@agent("t-boom")
def boom(ctx: Context) -> None:
    raise ValueError("boom")


@agent("t-notask")
def notask(ctx: Context) -> None:
    ctx.model()
