"""``make demo``: a fleet of twenty agents shares one GPU for a minute.

The GPU is a simulated 24 GiB one, or the real GPU 0 when NVML lists one (``--gpu``); on a real
GPU every declared size is scaled to its memory, so the line forms the same way.

What runs, all of it real and in its own processes:

- the fleet runner (``gpulock fleet``, APScheduler) starting the twenty agents of
  ``gpulock.agents.demo_agents`` on second-granularity schedules with jitter, each run its own
process;
- the governor (``gpulock governor``): the watchdog evicts idle models when the GPU passes 75 %;
  while it stays over 80 % the ladder climbs a level every two passes, through ``reduce``,
  ``evict-idle`` and ``force-evict`` up to ``freeze`` (no new GPU admissions), and walks back
  down a level per 6 s of clear signals: a busy minute usually reaches ``freeze`` and comes
  back down, and the summary says how high it went and where it ended;
- the router's three tiers: a tiny real llama.cpp model (written on the spot, no download) on the
  simulated GPU and on the CPU, and a "cloud" that is llama.cpp's OpenAI-compatible server on
  127.0.0.1 with a small daily budget that runs out during the demo.

The fleet runs for ``--seconds``, then on (at most ``OVERTIME_S`` more) until every agent has
run at least once, which on a loaded 2-core machine the slower-period ones may not have done
yet.  Then it prints a summary (runs, skips, the fires the fleet dropped, waits p50/p99, GPU
handoffs, evictions, governor level changes, route choices by tier) and writes
``demo-report.html`` (``gpulock report``): who held the GPU when, queue length and VRAM over
time.  Everything lives in ``.demo/``; a real queue is
never touched.  ``python -m gpulock.agents.demo --seconds 15`` is the short version the tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gpulock.agents.demo_agents import INPUTS, VARIANTS
from gpulock.core import children
from gpulock.core.shared import EXAMPLES

CLOUD_KEY_ENV = "GPULOCK_DEMO_CLOUD_KEY"
FLAKY = "flaky-gpu"  # the fleet's twentieth agent: dies by SIGKILL holding the GPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


GIB = 1024**3


def _gpu(mode: str) -> tuple[int | None, str]:
    """(the real GPU 0's size, or None to simulate 24 GiB; a line saying which)."""
    if mode == "simulated":
        return None, "one simulated 24 GiB GPU"
    from gpulock.core import devices

    report = devices.probe(None, environ={})
    dev = report.get(0)
    if dev is not None and dev.total_bytes:
        return dev.total_bytes, f"the real GPU 0 ({dev.name}, {dev.total_bytes / GIB:.0f} GiB)"
    if mode == "real":
        raise SystemExit(f"error: no real GPU: {report.problem or 'NVML lists none'}")
    return None, f"one simulated 24 GiB GPU (no real one: {report.problem or 'none listed'})"


def _config(root: Path, model: Path, port: int, real_bytes: int | None) -> str:
    m = str(model)
    scale = 1.0 if real_bytes is None else real_bytes / (24 * GIB)

    def gib(n: float) -> str:
        return f"{max(1, int(n * 1024 * scale))}MiB"

    cloud = (
        f"{{tier: cloud, backend: openai, model: tiny-cloud, base_url: http://127.0.0.1:{port}/v1,"
        f" api_key_env: {CLOUD_KEY_ENV}, price: {{input: 0.01, output: 0.03}}, timeout: 20s}}"
    )
    return f"""\
# Written by `make demo` (gpulock/agents/demo.py).  One simulated 24 GiB GPU; every model is the
# same tiny llama.cpp file, declared at the sizes real ones would have (vram:), so the line forms.
state_dir: {root / "state"}
{"simulate: 24GiB" if real_bytes is None else "# the real GPU: NVML"}
reserve: {gib(2)}
watchdog:
  interval: 1s
  threshold: 75%
  min_idle: 2s
  hysteresis: 5%
governor:
  samples: 2
  cooldown: 6s
  vram_pressure: 80%
router:
  cooldown: 10s
  daily_budget: 0.03
  defaults: {{n_ctx: 2048, max_tokens: 24}}
routes:
  summarize:
    - {{tier: gpu, backend: llama_cpp, model: {m}, vram: {gib(6)}, name: qwen-7b-q4}}
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8}}
  summarize-fast:
    - {cloud}
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8}}
  classify:
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8, n_ctx: 1024}}
  tag:
    - {{tier: gpu, backend: llama_cpp, model: {m}, vram: {gib(4)}, policy: cold-start,
       name: tagger-3b}}
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8}}
  draft:
    - {cloud}
    - {{tier: gpu, backend: llama_cpp, model: {m}, vram: {gib(8)}, name: qwen-14b-q4}}
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8}}
  speech:
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8, n_ctx: 1024}}
  chat:
    - {{tier: gpu, backend: llama_cpp, model: {m}, vram: {gib(9)}, name: assistant-8b}}
    - {{tier: cpu, backend: llama_cpp, model: {m}, name: qwen-0.5b-q8}}
"""


# After --seconds the fleet runs on, at most this long, until every agent has run once: on a
# loaded 2-core machine the first runs of the slower-period agents can still be in line then.
OVERTIME_S = 90.0


def _fleet(work: Path, seconds: float) -> str:
    # Twenty agents on two cores: the executor's six slots are often all busy, and a fire
    # that waited in line past misfire_grace would be dropped (fleet-missed "late") without
    # ever running.  A grace as long as the whole demo lets it run late instead; coalescing
    # still folds the fires it missed meanwhile into that one run.
    grace = int(seconds + OVERTIME_S)
    lines = [
        "# Written by `make demo`: twenty agents on second-granularity schedules.",
        "fleet:",
        "  jitter: 2s",
        f"  misfire_grace: {grace}s",
        "  grace: 4s",  # the demo's agents are short; a stopped demo should stop soon
        "  max_parallel: 6",
        "agents:",
    ]
    periods = [9, 11, 13, 15, 17, 19, 21]
    for i, name in enumerate(VARIANTS):
        args = json.dumps([str(work / INPUTS[name])])
        every = periods[i % len(periods)]
        lines.append(f"  - {{name: {name}, every: {every}s, args: {args}, timeout: 20s}}")
    lines.append(f"  - {{name: {FLAKY}, every: 7s, timeout: 10s}}")
    return "\n".join(lines) + "\n"


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# How long each helper (fleet, assistant, governor, cloud) gets after SIGTERM before SIGKILL:
# they are stopped one after another, so a stopped demo ends within about four of these.
STOP_WAIT_S = 6.0


class _Stopped(Exception):
    """SIGTERM or SIGHUP reached the demo: unwind, so that what it started is stopped too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_stop_requested: list[int] = []
_DEMO_PID = os.getpid()


def _on_signal(signum: int, _frame: object) -> None:
    if os.getpid() != _DEMO_PID:
        # A child between fork and exec (see _child_setup) runs the demo's handler: the signal
        # is for the child, which must end as the signal says, never go on ignoring it.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    # Only noted here: the demo acts on it at the points _check_stop marks.  Raising from the
    # handler could land inside subprocess.Popen (between its fork and its bookkeeping) and
    # lose track of a child: a full `make test` once saw a stopped demo that did not end.
    for s in _STOP_SIGNALS:  # once: a second signal must not cut the clean-up short
        signal.signal(s, signal.SIG_IGN)
    _stop_requested.append(signum)


def _check_stop() -> None:
    """Unwind now if SIGTERM or SIGHUP came: the ``with`` blocks stop what was started."""
    if _stop_requested:
        raise _Stopped(_stop_requested[0])


def _child_setup() -> Callable[[], None]:
    """The preexec_fn of every process the demo starts.

    It gives the child the default SIGTERM and SIGHUP: the demo ignores both once it is
    stopping, and an ignored signal stays ignored across exec (a fleet started then could be
    stopped only by SIGKILL).  Then, on Linux, it has the kernel SIGTERM the child when the
    demo dies, even by SIGKILL (a CI timeout): what it started would otherwise run on.
    """
    prctl: Callable[[int, int], int] | None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the demo's own clean-up must do
        prctl = None
    parent = os.getpid()

    def setup() -> None:
        for s in _STOP_SIGNALS:  # first: whatever came before this is undone here
            signal.signal(s, signal.SIG_DFL)
        if prctl is None:
            return
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the demo died between the fork and here: too late for it
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


@contextlib.contextmanager
def _process(
    argv: Sequence[str], env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        p = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_child_setup(),  # safe: the demo starts no threads
        )
    try:
        _check_stop()
        yield p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_stop()
        if proc.poll() is not None:
            raise SystemExit(f"error: the demo's cloud server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=1):  # noqa: S310 (our own 127.0.0.1 server)
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("error: the demo's cloud server did not answer within 60 s")


def _events(state: Path) -> list[dict[str, object]]:
    from gpulock.core import events

    return list(events.read(state))


def _progress(state: Path, elapsed: float) -> str:
    evs = _events(state)
    runs = Counter(str(e.get("outcome")) for e in evs if e.get("event") == "agent")
    tiers = Counter(str(e.get("tier")) for e in evs if e.get("event") == "call" and e.get("ok"))
    grants = sum(1 for e in evs if e.get("event") == "acquire")
    evictions = sum(1 for e in evs if e.get("event") == "evict")
    level = "normal"
    for e in evs:
        if e.get("event") in ("escalate", "deescalate") and e.get("level"):
            level = str(e["level"])
    changes = sum(1 for e in evs if e.get("event") in ("escalate", "deescalate"))
    done = ", ".join(f"{k} {v}" for k, v in sorted(runs.items())) or "none yet"
    calls = ", ".join(f"{k} {v}" for k, v in sorted(tiers.items())) or "none yet"
    return (
        f"  {elapsed:4.0f}s  runs: {done} | GPU grants {grants} | model calls: {calls} | "
        f"evictions {evictions} | governor {level} ({changes} changes)"
    )


def _not_run(state: Path) -> list[str]:
    """The demo's fleet agents without a ``fleet-run`` event yet."""
    ran = {e.get("agent") for e in _events(state) if e.get("event") == "fleet-run"}
    return [n for n in (*VARIANTS, FLAKY) if n not in ran]


def _watch_fleet(fleet_proc: subprocess.Popen[bytes], state: Path, seconds: float) -> None:
    """Print progress lines; after ``seconds``, stop the fleet once every agent has run (or
    ``OVERTIME_S`` more have passed) with SIGTERM: the fleet's grace lets runs finish."""
    start = time.monotonic()
    every = min(10.0, max(1.0, seconds / 6))
    shown = ""
    stopping = noted = False
    while fleet_proc.poll() is None:
        next_line = time.monotonic() + (1.0 if noted else every)
        while fleet_proc.poll() is None and time.monotonic() < next_line:
            _check_stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                fleet_proc.wait(0.2)
        elapsed = time.monotonic() - start
        line = _progress(state, elapsed)
        if line != shown:  # the fleet ending just after a line: not twice
            print(line, flush=True)
            shown = line
        if stopping or fleet_proc.poll() is not None or elapsed < seconds:
            continue
        missing = _not_run(state)
        if missing and elapsed < seconds + OVERTIME_S:
            if not noted:
                noted = True
                print(
                    f"  {len(missing)} agent(s) not run yet ({', '.join(missing)}): the fleet "
                    f"runs on until they have, at most {OVERTIME_S:.0f} s more",
                    flush=True,
                )
            continue
        if missing:
            print(f"warning: never ran in time: {', '.join(missing)}", flush=True)
        stopping = True
        fleet_proc.send_signal(signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpulock.agents.demo", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="how long the fleet runs (then on until every agent ran once)",
    )
    p.add_argument("--dir", default=".demo", help="the demo's folder (state, model, inputs)")
    p.add_argument("--report", default="demo-report.html", help="where the HTML report goes")
    p.add_argument(
        "--gpu",
        choices=("auto", "real", "simulated"),
        default="auto",
        help="the real GPU 0 when NVML lists one (auto), or a simulated 24 GiB GPU",
    )
    args = p.parse_args(argv)
    # SIGTERM (`timeout`, CI, systemd) would end Python without its `finally` blocks, leaving
    # the cloud server, the governor and the fleet running: unwind instead, like Ctrl-C.
    _stop_requested.clear()
    previous = {s: signal.signal(s, _on_signal) for s in _STOP_SIGNALS}
    try:
        return _demo(args)
    except _Stopped as e:
        print(f"demo stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("demo interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _demo(args: argparse.Namespace) -> int:
    from gpulock import report
    from gpulock.router.tiny_model import ensure_tiny_llama

    root = Path(args.dir).absolute()
    state, work, logs = root / "state", root / "work", root / "logs"
    for d in (state, work, logs):
        shutil.rmtree(d, ignore_errors=True)
    for d in (root, work, logs):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    model = ensure_tiny_llama(root / "models")
    data = EXAMPLES / "data"
    for folder in sorted(set(INPUTS.values())):
        shutil.copytree(data / folder, work / folder)
    port = _free_port()
    real_bytes, gpu_text = _gpu(args.gpu)
    config = root / "gpulock.yaml"
    config.write_text(_config(root, model, port, real_bytes))
    fleet = root / "fleet.yaml"
    fleet.write_text(_fleet(work, args.seconds))

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(
        GPULOCK_CONFIG=str(config),
        GPULOCK_STATE_DIR=str(state),
        GPULOCK_AGENT_MODULES="gpulock.agents.demo_agents",
        GPULOCK_DEMO_ASSISTANT_S=str(max(5.0, args.seconds - 5)),
        GPULOCK_NO_PROGRESS="1",
        GPULOCK_DEMO_SCALE=str(1.0 if real_bytes is None else real_bytes / (24 * GIB)),
        **{CLOUD_KEY_ENV: "demo-not-a-secret"},
    )
    print(
        f"gpulock demo: {len(VARIANTS) + 1} agents on a fleet and an assistant share "
        f"{gpu_text} for {args.seconds:.0f} s (folder {root})"
    )
    print("  cloud: llama.cpp's OpenAI-compatible server on 127.0.0.1 (the tiny model)")
    server = [
        *children.python("-m", "llama_cpp.server"),
        "--model", str(model), "--model_alias", "tiny-cloud", "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", "2048", "--n_gpu_layers", "0",
    ]  # fmt: skip
    with _process(server, env, logs / "cloud.log") as cloud:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", cloud, 60)
        with _process(children.python("-m", "gpulock", "governor"), env, logs / "governor.log"):
            print(
                "  governor: running (watchdog at 75 %; over 80 % the ladder climbs, up to "
                "freeze, and walks back down once it clears)"
            )
            # The assistant is the one long-lived agent: started once, here, for the whole run.
            assistant = children.python("-m", "gpulock.agents", "run", "assistant")
            # stopped below, by SIGTERM
            run = children.python("-m", "gpulock", "fleet", str(fleet))
            with (
                _process(assistant, env, logs / "assistant.log"),
                _process(run, env, logs / "fleet.log") as fleet_proc,
            ):
                _watch_fleet(fleet_proc, state, args.seconds)
                if fleet_proc.returncode != 0:
                    print(f"warning: the fleet exited {fleet_proc.returncode}; see {logs}")

    _check_stop()
    data_ = report.build(_events(state))
    print("\nsummary")
    for line in report.summary_lines(data_):
        print("  " + line)
    out = Path(args.report).absolute()
    report.write_report(state, out)
    print(f"\nreport: {out}  (the same for any state folder: gpulock report --out FILE)")
    print(f"logs: {logs}; agents' own logs: {state}/agents/<name>/log.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
