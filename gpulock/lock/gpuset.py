"""Which GPUs a ticket asks for: ``gpu=`` (an index, a set of them, ``any``), ``gpus=`` (how
many at once), ``prefer=`` (where the job is warm), and each GPU's budget for a ``need``.

Checked before a ticket is taken, so a bad value or a set that can never be granted (too few
GPUs, a need no GPU of it can fit) is an error at once, never a wait for ever.  One GPU asked,
the common case, costs what it always did: no parsing, no device probe beyond its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpulock.core import devices
from gpulock.core.config import Config
from gpulock.core.errors import NeedTooLarge, TooFewGpus
from gpulock.core.units import parse_gpus

# What ``gpu=`` takes: an index, a set of indices (a list, or "0,2"), "any", or None (default).
GpuArg = int | str | Sequence[int] | None
# GPUs where the job is warm already (``prefer=``): a list, or GPU -> why.
Prefer = Sequence[int] | Mapping[int, str] | None


def count_of(gpus: int | None) -> int:
    """How many GPUs at once ``gpus=`` asks for (default 1); ValueError for anything else."""
    if gpus is None:
        return 1
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a number of GPUs >= 1, got {gpus!r}")
    return gpus


def gpu_set(cfg: Config, gpu: GpuArg, count: int = 1) -> tuple[int, ...]:
    """The GPUs a ticket may be granted on, from ``gpu`` (or the config's ``default_gpu``):
    one index, a set, or ``any`` (the GPUs this machine has; gpu0 when it cannot tell).

    ``count`` GPUs at once need a set: without ``gpu`` it is every GPU (``default_gpu``'s set
    if it names one).  ValueError names a bad value; TooFewGpus a set smaller than ``count``.
    """
    asked = cfg.default_gpus if gpu is None else gpu
    if type(asked) is int and asked >= 0 and count == 1:
        return (asked,)  # one GPU: the common case, as cheap as it always was
    if isinstance(asked, bool) or (isinstance(asked, int) and asked < 0):
        raise ValueError(f"gpu must be a GPU index >= 0, a set of them or 'any', got {gpu!r}")
    try:
        spec = parse_gpus(asked, key="gpu")
    except ValueError as e:
        raise ValueError(str(e)) from None
    if isinstance(spec, int) and count > 1:
        if gpu is not None:
            raise TooFewGpus(count, (spec,), "a single GPU was named")
        spec = "any"
    if spec == "any":
        known = devices.known_gpus(cfg)
        if known is None and count > 1:
            raise TooFewGpus(count, (0,), "this machine's GPUs cannot be counted")
        found = known[0] if known is not None else (0,)
        if not found:
            found = (0,)
        if len(found) < count:
            raise TooFewGpus(count, found, f"this machine has {len(found)}")
        return found
    gset = (spec,) if isinstance(spec, int) else tuple(int(g) for g in spec)
    if len(gset) < count:
        raise TooFewGpus(count, gset, f"the set has {len(gset)}")
    return gset


def asked_of(gset: Sequence[int], count: int) -> int | list[int]:
    """What a ticket asked for, as JSON says it (``gpus``): the number of GPUs at once when
    more than one, else the set."""
    return count if count > 1 else list(gset)


def budget_of(cfg: Config, total_bytes: int | None) -> int | None:
    """What holders may use of a GPU of ``total_bytes``: its memory less the reserve (None:
    its size is unknown)."""
    return None if total_bytes is None else total_bytes - cfg.reserve_bytes(total_bytes)


def budgets(
    cfg: Config, gset: tuple[int, ...], count: int, need_bytes: int | None
) -> tuple[dict[int, int | None], tuple[int, ...]]:
    """Each GPU's budget (its memory less the reserve) where a need asks, and the set less
    the GPUs the need can never fit (NeedTooLarge when fewer than ``count`` are left)."""
    if need_bytes is None:
        return dict.fromkeys(gset), gset
    if len(gset) == 1:  # one GPU: exactly as it always was
        budget = budget_of(cfg, devices.total_bytes(gset[0], cfg))
        if budget is not None and need_bytes > budget:
            raise NeedTooLarge(gset[0], need_bytes, budget)
        return {gset[0]: budget}, gset
    report = devices.probe(cfg)
    budgets: dict[int, int | None] = {}
    unfit: list[tuple[int, int]] = []
    for g in gset:
        dev = report.get(g)
        budget = budget_of(cfg, dev.total_bytes if dev is not None else None)
        if budget is not None and need_bytes > budget:
            unfit.append((g, budget))
        else:
            budgets[g] = budget
    if len(budgets) < count:
        g, budget = max(unfit, key=lambda u: u[1])
        raise NeedTooLarge(g, need_bytes, budget)
    return budgets, tuple(budgets)


def prefer_of(prefer: Prefer, gset: Sequence[int]) -> dict[int, str] | None:
    """``prefer=`` as GPU -> why, only the GPUs of the set; None when it names none."""
    if not prefer:
        return None
    if isinstance(prefer, Mapping):
        return {int(g): str(why) for g, why in prefer.items() if g in gset}
    return {int(g): "preferred by the caller" for g in prefer if g in gset}
