"""Replacing and rolling back one engine's running policy, with the history a rollback needs:
what the REPL and the admin routes (`/admin/policy`) both drive."""

from __future__ import annotations

import time
from pathlib import Path

import attrs

from engine.policy import Policy
from shunter.engine import Engine
from shunter.policy_source import source_diff


@attrs.frozen(kw_only=True)
class PolicyChange:
    old: Policy
    new: Policy
    version: int
    """The engine's policy version once `new` runs."""

    @property
    def diff(self) -> str:
        return source_diff(self.old, self.new)


class PolicyControl:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.previous: list[Policy] = []
        """Policies replaced so far, the latest last (what `diff` and `rollback` use)."""
        self.loaded_at = time.monotonic()
        """When the running policy started (wall clock, for "running for N s")."""

    async def switch(self, new: Policy | str, *, base_dir: Path | None = None) -> PolicyChange:
        """Run `new`; raises PolicyError (and changes nothing) when it cannot run here."""
        old = self.engine.policy
        running = await self.engine.replace_policy(new, base_dir=base_dir)
        self.previous.append(old)
        self.loaded_at = time.monotonic()
        return PolicyChange(old=old, new=running, version=self.engine.policy_version)

    async def rollback(self) -> PolicyChange | None:
        """Back to the policy before the running one (a new version); None when there is none."""
        if not self.previous:
            return None
        back, old = self.previous[-1], self.engine.policy
        await self.engine.replace_policy(back)
        self.previous.pop()
        self.loaded_at = time.monotonic()
        return PolicyChange(old=old, new=back, version=self.engine.policy_version)

    def last_diff(self) -> str | None:
        """From the previous policy to the running one; None when nothing was replaced."""
        if not self.previous:
            return None
        return source_diff(self.previous[-1], self.engine.policy)

    def running_s(self) -> float:
        return time.monotonic() - self.loaded_at
