"""``gpulock route TASK``: what ``router.get_model(TASK)`` would choose now, and why.

Found by ``gpulock`` through the ``gpulock.commands`` entry point (``route``).  Loads no model
and writes no event: it runs the same probe and the same pure choice as ``get_model``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from gpulock.cli import Parser, duration_arg, run_command

EX_OK, EX_TEMPFAIL = 0, 75

DESCRIPTION = """\
Show which model router.get_model(TASK) would hand out now, on this machine: the first
candidate of the task's route (config: routes:) that fits, or a warm model of the same tier;
with --explain, every candidate and why it was passed over or rejected (no GPU, too little VRAM,
governor level, GPU queue longer than --deadline, budget spent, cooling down after errors, model
file or API key variable missing), and whether each can call tools (a request with tools goes
only to those that can: --tools chooses as for one).  Without TASK, list the tasks and their
candidates."""

EPILOG = """\
exit codes: 0 a candidate fits; 75 none fits now (get_model would raise NoModelAvailable);
1 error (bad config: file, line and key are named); 2 usage (unknown task: the known ones are
listed)."""


def build_parser(prog: str = "gpulock route") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", nargs="?", metavar="TASK", help="a task name from the routes table")
    p.add_argument("--explain", action="store_true", help="every candidate and why")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--deadline", type=duration_arg, metavar="DUR", help="as get_model(deadline=...): 30s, 2m"
    )
    p.add_argument("--prefer", metavar="TIER|NAME", help="as get_model(prefer=...)")
    p.add_argument(
        "--tools",
        action="store_true",
        help="choose as gpulock serve does for a request with tools: only candidates that can "
        "call them",
    )
    p.add_argument("--config", metavar="FILE", help="config file (default: the usual lookup)")
    p.add_argument("--state-dir", metavar="DIR", help="state folder (default: as gpulock's)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(_main, argv)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from gpulock.router.select import context, explain

    if args.task is None:
        _, table = context(args.config, args.state_dir)
        return _list(table, as_json=args.json)
    choice = explain(
        args.task,
        deadline=args.deadline,
        prefer=args.prefer,
        config=args.config,
        state_dir=args.state_dir,
        tools=args.tools,
    )
    settings, table = context(args.config, args.state_dir)
    can: dict[int, Any] = {}
    if args.json or args.explain:
        from gpulock.router.probe import tools_prober

        prober = tools_prober(settings)
        can = {id(v): prober(v.candidate) for v in choice.verdicts}
    if args.json:
        from gpulock.router.peers import here_name

        doc = choice_json(choice, here_name(settings), can, table.settings)
        print(json.dumps(doc, indent=2))
    elif args.explain or choice.chosen is None:
        print(choice.explain())
        for line in reservations(choice, table.settings):
            print(line)
        if args.explain:
            from gpulock.router.tools import summary

            print(summary([(v.candidate.name, can[id(v)]) for v in choice.verdicts]))
    else:
        c = choice.chosen.candidate
        print(f"{args.task}: {c.tier} {c.name} ({c.key}): {choice.chosen.reason}")
    return EX_OK if choice.chosen is not None else EX_TEMPFAIL


def reservations(choice: Any, rs: Any) -> list[str]:
    """For each cloud candidate with a budget: how a call's reservation is computed."""
    from gpulock.router import budget

    return [
        f"  {v.candidate.name}: {budget.explain(v.candidate)}"
        for v in choice.verdicts
        if budget.needed(v.candidate, rs)
    ]


def choice_json(
    choice: Any, here: str | None = None, tools: dict[int, Any] | None = None, rs: Any = None
) -> dict[str, Any]:
    """``here``: this host's name, for ``host`` when the chosen candidate runs here;
    ``tools``: each verdict's tool support (by ``id``), for its ``tools`` entry; ``rs``: the
    router's settings, for each budgeted candidate's ``reservation``."""
    from gpulock.router import budget

    def verdict(v: Any) -> dict[str, Any]:
        c = v.candidate
        can = (tools or {}).get(id(v))
        return {
            "key": c.key,
            "name": c.name,
            "tier": c.tier,
            "backend": c.backend,
            "model": c.model,
            "policy": c.policy,
            "n_ctx": c.n_ctx,
            "ok": v.ok,
            "chosen": v is choice.chosen,
            "reason": v.reason,
            "gpu": v.gpu,
            "gpus": list(v.gpus) or ([v.gpu] if v.gpu is not None else []),
            "need_bytes": v.need_bytes,
            "warm": v.warm,
            **({"tools": {"ok": can.ok, "how": can.how}} if can is not None else {}),
            "reservation": (budget.explain(c) if rs is not None and budget.needed(c, rs) else None),
        }

    chosen = choice.chosen
    return {
        "task": choice.task,
        "level": choice.level,
        "host": (chosen.candidate.host or here) if chosen else None,
        "chosen": verdict(choice.chosen) if choice.chosen else None,
        "candidates": [verdict(v) for v in choice.verdicts],
    }


def _list(table: Any, *, as_json: bool) -> int:
    if as_json:
        out = {
            task: [{"key": c.key, "tier": c.tier, "name": c.name, "model": c.model} for c in cands]
            for task, cands in sorted(table.tasks.items())
        }
        print(json.dumps(out, indent=2))
        return EX_OK
    if not table.tasks:
        print("no routes: add a routes: section to the config (see README, Router)")
        return EX_OK
    for task in table.known:
        names = ", ".join(f"{c.tier} {c.name}" for c in table.tasks[task])
        print(f"{task}: {names}")
    return EX_OK
