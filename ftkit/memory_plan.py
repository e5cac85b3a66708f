"""Bridge between a Plan and the memory model in :mod:`ftkit.memory` (placeholder until the planner lands)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class _Choice:
    stage: int
    offload_optimizer: str


@dataclass
class Report:
    tight: bool = False
    room_for_overlap: bool = True
    host_tight: bool = False
    choice_reason: str = ""

    def choice_for(self, stage: Any, opt: Any) -> _Choice:
        return _Choice(2 if stage == "auto" else stage, "none" if opt == "auto" else opt)


def plan_memory(plan: Any) -> Report:
    return Report()
