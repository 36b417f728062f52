"""What asking a resident to leave came to: one record, shared by library and tenant eviction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EvictResult:
    id: str
    name: str
    gpu: int
    pid: int
    outcome: str  # freed | unloaded | not-freed | refused | busy | no-answer | owner-gone | gone
    # gone: a tenant model that was no longer loaded when asked
    detail: str
    freed_bytes: int | None
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.outcome in ("freed", "unloaded", "owner-gone", "already-unloaded", "gone")
