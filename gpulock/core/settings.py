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
    config: Config | str | None = None, state_dir: str | os.PathLike[str] | None = None
) -> Settings:
    """Resolve the config (a Config, a path, or the usual lookup) and check the state folder."""
    cfg = config if isinstance(config, Config) else load_config(config)
    path = (
        Path(state_dir).expanduser().absolute()
        if state_dir
        else state.resolve_state_dir(cfg.state_dir)
    )
    return Settings(cfg, state.ensure_state_dir(path, group=cfg.group))
