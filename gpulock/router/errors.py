"""The router's errors (part of gpulock's one tree: both are ``gpulock.GpulockError``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpulock.core.errors import GpulockError, known_hint

if TYPE_CHECKING:
    from gpulock.router.choose import Choice


class UnknownTask(GpulockError, KeyError):
    """No route for this task name; the message lists the known ones."""

    exit_code = 2  # a usage mistake, for the CLI

    def __init__(self, task: str, known: list[str], config_file: str | None = None) -> None:
        self.task = task
        self.known = list(known)
        if known:
            hint = known_hint(task, known, "known tasks")
        else:
            where = config_file or "the config file (gpulock.yaml)"
            hint = f"add a routes: section to {where}"
        super().__init__(f"unknown task {task!r}", hint=hint)

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class UnknownPreference(GpulockError, ValueError):
    """``prefer=`` names neither a tier nor a candidate of the task: a typo would go unseen."""

    exit_code = 2  # a usage mistake, for the CLI

    def __init__(self, task: str, prefer: str, tiers: Sequence[str], names: Sequence[str]):
        self.task = task
        self.prefer = prefer
        super().__init__(
            f"prefer={prefer!r} is neither a tier nor a model of task {task!r}",
            hint=f"tiers: {', '.join(tiers)}; models of {task}: {', '.join(names)}",
        )


class NoModelAvailable(GpulockError):
    """Every candidate of a task was rejected or failed.  ``reasons``: (key, name, tier, why)."""

    exit_code = 75  # EX_TEMPFAIL: try again later, like a GPU that stayed busy

    def __init__(self, task: str, choice: Choice | None = None, *, broke: str | None = None):
        self.task = task
        self.reasons: list[tuple[str, str, str, str]] = []
        if choice is not None:
            self.reasons = [
                (v.candidate.key, v.candidate.name, v.candidate.tier, v.reason)
                for v in choice.verdicts
            ]
        if broke is not None:
            head = f"the answer for task {task!r} broke off mid-stream ({broke})"
        else:
            head = f"no model available for task {task!r}"
        lines = [head] + [
            f"  {tier} {name} ({key}): {why}" for key, name, tier, why in self.reasons
        ]
        super().__init__("\n".join(lines), hint=f"gpulock route {task} --explain")
