"""The resolved place a process works in: its config and its (checked) state folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpulock.core import events, state
from gpulock.core.config import Config, load_config


@dataclass(frozen=True, slots=True)
class Settings:
    config: Config
    state_dir: Path

    @property
    def group(self) -> str | None:
        return self.config.group

    @property
    def file_mode(self) -> int:
        return state.file_mode(self.config.group)

    def gpu_dir(self, gpu: int, *, create: bool = True) -> Path:
        """The queue folder of one GPU (``gpu<N>``), created safely on first use."""
        if create:
            return state.ensure_subdir(self.state_dir, f"gpu{gpu}", group=self.config.group)
        return self.state_dir / f"gpu{gpu}"

    def emit(self, event: str, **fields: Any) -> None:
        events.emit(
            self.state_dir,
            event,
            max_bytes=self.config.events_max_bytes,
            mode=self.file_mode,
            **fields,
        )


def load(
    config: Config | str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    *,
    create: bool = True,
) -> Settings:
    """Resolve the config (a Config, a path, or the usual lookup) and check the state folder.

    ``create=False`` for what only reads the state (``status``, ``history``, ``report``,
    ``replay``, ``metrics``...): a folder that does not exist is then NoStateDir, with a hint
    naming where its path came from, never a new folder (the writers make it: ``run``,
    ``pool``, ``serve``, the governor, agents).
    """
    cfg = config if isinstance(config, Config) else load_config(config)
    path = (
        Path(state_dir).expanduser().absolute()
        if state_dir
        else state.resolve_state_dir(cfg.state_dir)
    )
    hint = None if create else _missing_hint(cfg, given=bool(state_dir))
    return Settings(
        cfg, state.ensure_state_dir(path, group=cfg.group, create=create, missing_hint=hint)
    )


def _missing_hint(cfg: Config, *, given: bool) -> str:
    """Where a missing state folder's path came from, and who makes the folder."""
    makers = "the commands that queue (gpulock run, pool, serve, the governor, agents) create it"
    if given:
        return f"check --state-dir; {makers}"
    if os.environ.get(state.ENV_STATE_DIR):
        return f"check ${state.ENV_STATE_DIR}; {makers}"
    if cfg.state_dir is not None:
        return f"check 'state_dir' in {cfg.path or 'the config'}; {makers}"
    return f"nothing has used gpulock here yet as this user: {makers}"
