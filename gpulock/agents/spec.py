"""Declaring agents: the ``@agent`` decorator, the ``AgentSpec`` it records, the registry.

::

    @agent("digest", task="summarize", schedule="*/10 * * * *", timeout="10m", need="6GiB")
    def digest(ctx: Context) -> None: ...

Everything is checked when the decorator runs (at import), so a typo in a schedule fails the
module's import with a ValueError naming the field, not a cron run at 03:00.  Pure but for the
process-wide registry; imports nothing heavy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, TypeVar

from gpulock.core import cronexpr
from gpulock.core.errors import GpulockError
from gpulock.core.units import parse_duration, parse_size

__all__ = ["AgentError", "AgentSpec", "agent", "check_schedule", "get", "registered"]

F = TypeVar("F", bound=Callable[..., Any])

NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9_-]*")

# Cron fields in order: name, lowest, highest, names allowed (index = value).
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_FIELDS: Final[tuple[tuple[str, int, int, Mapping[str, int]], ...]] = (
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {n: i + 1 for i, n in enumerate(_MONTHS)}),
    ("day of week", 0, 7, {n: i for i, n in enumerate(_DAYS)}),  # 0 and 7 are both Sunday
)


# As cron has them; '@reboot' is not a time, so it is not a schedule here.
_CRON_ALIASES: Final = tuple(cronexpr.ALIASES)


class AgentError(GpulockError):
    """An agent asked the runtime for something it cannot give (a model without a task...)."""


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """One declared agent.  ``module`` is where it was defined (a dotted name)."""

    name: str
    # Called with the run's Context (gpulock.agents.context, which imports this module: named
    # here only in words, so that the two stay a line and not a circle).
    func: Callable[[Any], object]
    task: str | None = None
    schedule: str | None = None  # a 5-field cron line, checked by check_schedule
    timeout_s: float | None = None  # bounds the waits (GPU, admission, router); None: no bound
    need_bytes: int | None = None  # VRAM for ctx.gpu(); None: the whole GPU
    gpu: int | None = None  # None: the config's default_gpu
    flush_every: int | None = None  # ctx.flush() after every N batch items
    description: str = ""
    # "auto" or N: the batch runs in that many worker processes (gpulock pool); None: in-process
    workers: int | str | None = None
    module: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The documented JSON object of ``agent list --json`` (everything but ``func``)."""
        return {
            "name": self.name,
            "task": self.task,
            "schedule": self.schedule,
            "timeout_s": self.timeout_s,
            "need_bytes": self.need_bytes,
            "gpu": self.gpu,
            "flush_every": self.flush_every,
            "workers": self.workers,
            "description": self.description,
            "module": self.module,
        }


_REGISTRY: dict[str, AgentSpec] = {}
EXAMPLES_PACKAGE: Final = (
    "gpulock.agents.examples"  # the built-in examples: a user's agent replaces one
)


def agent(
    name: str,
    *,
    task: str | None = None,
    schedule: str | None = None,
    timeout: float | str | None = None,
    need: int | str | None = None,
    gpu: int | None = None,
    flush_every: int | None = None,
    description: str = "",
    workers: int | str | None = None,
) -> Callable[[F], F]:
    """Register the decorated function as agent ``name``; the function is returned unchanged.

    ``workers="auto"`` (or a number) runs the agent's batch in that many processes, each
    holding the GPU with ``need`` (``gpulock pool``): ``ctx.batch()`` splits the items between
    them so that each is done once (see ``gpulock.agents.poolbatch``).

    Raises ValueError, naming the field, for a bad name, schedule, timeout, need, gpu,
    flush_every or workers, and for a name already registered in this process.
    """
    spec_fields = _checked(name, task, schedule, timeout, need, gpu, flush_every, description)
    spec_fields["workers"] = _checked_workers(workers, spec_fields["need_bytes"])

    def register(func: F) -> F:
        if not callable(func):
            raise ValueError(f"@agent({name!r}) must decorate a function, got {func!r}")
        module = getattr(func, "__module__", None) or "?"
        previous = _REGISTRY.get(name)
        if previous is not None:
            # A built-in example must not cost the user their own agent of the same name (their
            # whole module would fail to import): theirs wins, whichever is imported first.
            if _is_example(module) and not _is_example(previous.module):
                return func
            if not (_is_example(previous.module) and not _is_example(module)):
                raise ValueError(
                    f"agent {name!r} is defined twice: {_where(previous.func, previous.module)} "
                    f"and {_where(func, module)}"
                )
        fields = dict(spec_fields)
        fields["description"] = fields["description"] or _summary(func)
        _REGISTRY[name] = AgentSpec(name=name, func=func, module=module, **fields)
        return func

    return register


def _checked(
    name: str,
    task: str | None,
    schedule: str | None,
    timeout: float | str | None,
    need: int | str | None,
    gpu: int | None,
    flush_every: int | None,
    description: str,
) -> dict[str, Any]:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"name: {name!r} is not an agent name: lower-case letters, digits, '-' and '_', "
            "starting with a letter or digit (e.g. 'digest', 'inbox-triage')"
        )
    if task is not None and (not isinstance(task, str) or not task.strip()):
        raise ValueError(f"task: expected a task name like 'summarize', got {task!r}")
    if schedule is not None:
        check_schedule(schedule)
    timeout_s = None if timeout is None else parse_duration(timeout, key="timeout")
    need_bytes = None if need is None else parse_size(need, key="need")
    if need_bytes is not None and need_bytes <= 0:
        raise ValueError(f"need: expected a size above 0, got {need!r}")
    if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0):
        raise ValueError(f"gpu: expected a GPU index >= 0, got {gpu!r}")
    if flush_every is not None and (
        isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1
    ):
        raise ValueError(f"flush_every: expected a whole number >= 1, got {flush_every!r}")
    if not isinstance(description, str):
        raise ValueError(f"description: expected text, got {description!r}")
    return {
        "task": task,
        "schedule": schedule,
        "timeout_s": timeout_s,
        "need_bytes": need_bytes,
        "gpu": gpu,
        "flush_every": flush_every,
        "description": description.strip(),
    }


def _checked_workers(workers: int | str | None, need_bytes: int | None) -> int | str | None:
    if workers is None:
        return None
    if workers != "auto" and (
        isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
    ):
        raise ValueError(f"workers: expected 'auto' or a whole number >= 1, got {workers!r}")
    if need_bytes is None:
        raise ValueError(
            "workers: needs need= too (each worker's VRAM decides how many fit), "
            "e.g. @agent(..., workers='auto', need='8.9GiB')"
        )
    return workers


def _is_example(module: str) -> bool:
    return module == EXAMPLES_PACKAGE or module.startswith(EXAMPLES_PACKAGE + ".")


def _where(func: Callable[..., Any], module: str) -> str:
    """``at FILE:LINE`` of a function (a file agent's module name is made up), else its module."""
    code = getattr(func, "__code__", None)
    if code is not None:
        return f"at {code.co_filename}:{code.co_firstlineno}"
    return f"in {module}"


def _summary(func: Callable[..., Any]) -> str:
    """The first line of the function's docstring: the description when none is given."""
    doc = (getattr(func, "__doc__", None) or "").strip()
    return doc.splitlines()[0].strip() if doc else ""


def check_schedule(schedule: str) -> None:
    """Check a classic 5-field cron line (``*/10 * * * *``, ``30 7 * * mon-fri``) or alias.

    Raises ValueError starting with ``schedule:`` and naming the bad field.
    """
    if not isinstance(schedule, str):
        raise ValueError(f"schedule: expected a cron line like '*/10 * * * *', got {schedule!r}")
    text = schedule.strip()
    if text.startswith("@"):
        if text.lower() in _CRON_ALIASES:
            return
        raise ValueError(
            f"schedule: unknown cron alias {schedule!r}; known: " + ", ".join(_CRON_ALIASES)
        )
    parts = text.split()
    if len(parts) != len(_CRON_FIELDS):
        raise ValueError(
            f"schedule: {schedule!r} has {len(parts)} fields, a cron line has 5: "
            "minute hour day-of-month month day-of-week, e.g. '*/10 * * * *'"
        )
    for text, (field_name, low, high, names) in zip(parts, _CRON_FIELDS, strict=True):
        for element in text.split(","):
            problem = _cron_element(element, low, high, names)
            if problem:
                raise ValueError(
                    f"schedule: {schedule!r}: {field_name} {text!r}: {problem} "
                    f"(allowed: {low}-{high}, '*', ranges a-b, steps */n, lists a,b)"
                )


def _cron_element(element: str, low: int, high: int, names: Mapping[str, int]) -> str | None:
    """Why one comma-separated element of a cron field is wrong, or None when it is right."""
    base, slash, step = element.partition("/")
    if slash and (not step.isdigit() or int(step) < 1):
        return f"step {step!r} is not a whole number >= 1"
    if base == "*":
        return None
    lo_text, dash, hi_text = base.partition("-")
    lo = _cron_value(lo_text, names)
    if lo is None:
        return f"{lo_text!r} is not a value"
    hi = lo
    if dash:
        hi_value = _cron_value(hi_text, names)
        if hi_value is None:
            return f"{hi_text!r} is not a value"
        hi = hi_value
    if not low <= lo <= high or not low <= hi <= high:
        return f"{base!r} is out of range"
    if lo > hi:
        return f"range {base!r} runs backwards"
    return None


def _cron_value(text: str, names: Mapping[str, int]) -> int | None:
    if text.isdigit():
        return int(text)
    return names.get(text.lower())


def get(name: str) -> AgentSpec | None:
    """The agent registered as ``name`` in this process, or None."""
    return _REGISTRY.get(name)


def registered() -> list[AgentSpec]:
    """Every agent registered in this process, by name."""
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def _relabel(module: str, label: str) -> None:
    """Show ``label`` as the module of the agents defined in ``module`` (a file's made-up name)."""
    for name, spec in list(_REGISTRY.items()):
        if spec.module == module:
            _REGISTRY[name] = replace(spec, module=label)
