"""``Context``: what an agent's function is handed for one run, and the agent's folder.

The context bounds every wait it does for the agent (the GPU, a model) by what is left of the
run's timeout, hands out models loaded once per run, and checkpoints ``batch`` loops.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, TextIO, TypeVar

from gpulock import Lease, acquire
from gpulock.agents import checkpoint
from gpulock.agents.progress import ProgressBar, wanted
from gpulock.agents.spec import AgentError, AgentSpec
from gpulock.core.errors import StateDirError
from gpulock.core.settings import Settings
from gpulock.core.state import ensure_subdir

if TYPE_CHECKING:
    from gpulock.router.model import Model

T = TypeVar("T")

AGENTS_DIR: Final = "agents"


def agent_dir(settings: Settings, name: str) -> Path:
    """``<state>/agents/<name>/``, created like the state folder (0700, or 2770 shared)."""
    base = ensure_subdir(settings.state_dir, AGENTS_DIR, group=settings.group)
    return ensure_subdir(base, name, group=settings.group)


class Context:
    """What an agent's function gets: its inputs, log, clock, GPU, models and batches.

    ``inputs`` are the positional arguments after NAME as paths, ``args`` the same as text;
    ``out`` is ``--out``.  ``remaining_s()`` is what is left of the timeout, which bounds every
    wait the runtime does for the agent.
    """

    def __init__(
        self,
        spec: AgentSpec,
        *,
        settings: Settings,
        args: Sequence[str] = (),
        out: Path | None = None,
        timeout_s: float | None = None,
        log: logging.Logger | None = None,
        stderr: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        pool_worker: int | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.task = spec.task
        self.args = list(args)
        self.inputs = [Path(a) for a in self.args]
        self.out = out
        self.settings = settings
        self.state_dir = settings.state_dir
        self.agent_dir = agent_dir(settings, spec.name)
        self.timeout_s = timeout_s
        self.log = log if log is not None else logging.getLogger(f"gpulock.agents.run.{spec.name}")
        self._stderr = stderr if stderr is not None else sys.stderr
        self._clock = clock
        self._started = clock()
        self._models: dict[tuple[str, str | None], Model] = {}
        self._flush_hooks: list[Callable[[], object]] = []
        self._bars: list[ProgressBar] = []
        # This run's index among the workers of a pooled agent (@agent(workers=...)), or None.
        self.pool_worker = pool_worker

    @property
    def checkpoint_path(self) -> Path:
        return self.agent_dir / checkpoint.CHECKPOINT_NAME

    def remaining_s(self) -> float | None:
        """Seconds left of the timeout (never below 0); None when there is no timeout."""
        if self.timeout_s is None:
            return None
        return max(0.0, self.timeout_s - (self._clock() - self._started))

    def model(self, task: str | None = None, *, prefer: str | None = None) -> Model:
        """The router's Model for ``task`` (default: the agent's), loaded once per run.

        Waits at most ``remaining_s()``; ``router.NoModelAvailable`` then makes the run a skip.
        ``flush()`` unloads every model handed out here; the next call reloads it.
        """
        chosen = task or self.task
        if not chosen:
            raise AgentError(
                f"agent {self.name!r} has no task, so ctx.model() cannot choose a model",
                hint="declare one, @agent(..., task='summarize'), or ask ctx.model('summarize')",
            )
        key = (chosen, prefer)
        found = self._models.get(key)
        if found is not None:
            return found
        from gpulock.router import (
            get_model,  # here: most cron runs that import agents need no model
        )

        model = get_model(
            chosen,
            deadline=self.remaining_s(),
            prefer=prefer,
            agent=self.name,
            config=self.settings.config,  # the run's --config and --state-dir, not the lookup
            state_dir=str(self.settings.state_dir),
        )
        self._models[key] = model
        self.on_flush(model.unload)
        return model

    def gpu(self, need: int | str | None = None) -> Lease:
        """Wait (at most ``remaining_s()``) for the agent's GPU; use as ``with ctx.gpu():``.

        ``need`` defaults to the agent's ``need`` (None: the whole GPU).  LockTimeout, when
        the wait runs out, makes the run a skip.
        """
        return acquire(
            gpu=self.spec.gpu,
            need=need if need is not None else self.spec.need_bytes,
            timeout=self.remaining_s(),
            name=self.name,
            config=self.settings.config,
            state_dir=self.settings.state_dir,
        )

    def on_flush(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` at every ``flush()`` (for things to drop every N items)."""
        self._flush_hooks.append(hook)

    def flush(self) -> None:
        """Unload every model handed out by ``model()`` and call the ``on_flush`` hooks.

        The runtime calls it after every ``flush_every`` items of a batch.
        """
        self.log.debug("flush", extra={"hooks": len(self._flush_hooks)})
        for hook in list(self._flush_hooks):
            hook()

    def batch(self, items: Iterable[T], *, key: Callable[[T], str] | None = None) -> Iterator[T]:
        """Iterate ``items`` with a checkpoint: a run killed half-way resumes where it stopped.

        ``key(item)`` (default ``str(item)``) names an item in the checkpoint.  An item counts
        as done when the loop asks for the next one (or ends normally); items done in an
        earlier run are skipped.  The checkpoint is removed once the loop ends normally.
        One checkpointed batch per run.
        """
        listed = list(items)
        name_of: Callable[[T], str] = key if key is not None else str
        keys = [name_of(item) for item in listed]
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"batch key must be text, got {k!r} from key={key!r}")
        path = self.checkpoint_path
        every = self.spec.flush_every
        if self.pool_worker is not None:  # one of a pool's workers: share the items
            from gpulock.agents import poolbatch

            def flushed(count: int) -> None:
                if every and count % every == 0:
                    self.flush()

            return poolbatch.pooled(
                listed,
                keys,
                checkpoint.resumed(path, keys),
                path=path,
                mode=self.settings.file_mode,
                group=self.settings.group,
                finished=flushed,
            )
        try:
            resumed = checkpoint.resumed(path, keys)
        except checkpoint.CheckpointError as e:
            if path.is_dir() and not path.is_symlink():
                # Nothing could replace it: fail before the first item, not after it.
                raise StateDirError(
                    str(path),
                    "is a folder, so the batch's progress could not be saved",
                    hint=f"move it away (mv {path} {path}.bad)",
                ) from None
            self.log.warning(
                f"ignoring checkpoint {path}: {e}; starting the batch over",
                extra={"checkpoint": str(path)},
            )
            resumed = set()
        skipped = sum(1 for k in keys if k in resumed)
        if skipped:
            self.log.info(
                f"resuming: {skipped} of {len(listed)} done",
                extra={"done": skipped, "total": len(listed)},
            )
        bar = ProgressBar(
            self._stderr, self.name, len(listed), skipped, enabled=wanted(self._stderr)
        )
        self._bars.append(bar)

        def finished(count: int) -> None:
            bar.update(skipped + count)
            if every and count % every == 0:
                self.flush()

        bar.start()
        return checkpoint.checkpointed(
            listed,
            keys,
            resumed,
            path=path,
            agent=self.name,
            mode=self.settings.file_mode,
            finished=finished,
            ended=bar.close,
        )

    def close(self) -> None:
        """End any progress line and unload the run's models.

        A batch left by an exception leaves its bar open; a llama.cpp model still loaded at
        interpreter exit prints a traceback from its ``__del__``, which cron would mail.
        """
        for bar in self._bars:
            bar.close()
        for model in list(self._models.values()):
            try:
                model.unload()
            except Exception as e:  # a failed unload must not turn a good run into an error
                self.log.warning(
                    "unloading a model failed", extra={"model": repr(model), "error": str(e)}
                )
        self._models.clear()
