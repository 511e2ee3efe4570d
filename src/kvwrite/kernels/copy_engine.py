"""Placeholder of the copy-engine path (SPEC §9.5, ``engine="ce"``); replaced by its real module.

``resolve(plan)``: the engine that runs a validated plan ("sm" or "ce"); ``run(plan)``: the plan
through copy engines."""

from __future__ import annotations

__all__ = ["resolve", "run"]


def resolve(plan) -> str:
    if plan.engine == "ce":
        raise NotImplementedError("engine='ce': the copy-engine path is not built yet")
    return "sm"


def run(plan) -> None:
    raise NotImplementedError("engine='ce': the copy-engine path is not built yet")
