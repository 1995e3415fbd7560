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
    old_version: int
    """The version `old` ran as."""
    restored: int | None = None
    """A rollback: the version that ran `new` before."""

    @property
    def diff(self) -> str:
        return source_diff(self.old, self.new)


class PolicyControl:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.previous: list[tuple[Policy, int]] = []
        """Policies replaced so far with the versions they ran as, the latest last (what `diff`
        and `rollback` use)."""
        self.loaded_at = time.monotonic()
        """When the running policy started (wall clock, for "running for N s")."""

    async def switch(self, new: Policy | str, *, base_dir: Path | None = None) -> PolicyChange:
        """Run `new`; raises PolicyError (and changes nothing) when it cannot run here."""
        old, old_version = self.engine.policy, self.engine.policy_version
        running = await self.engine.replace_policy(new, base_dir=base_dir)
        self.previous.append((old, old_version))
        self.loaded_at = time.monotonic()
        return PolicyChange(old=old, new=running, version=self.engine.policy_version,
                            old_version=old_version)

    async def rollback(self) -> PolicyChange | None:
        """Back to the policy before the running one (a new version); None when there is none."""
        if not self.previous:
            return None
        (back, back_version), old = self.previous[-1], self.engine.policy
        old_version = self.engine.policy_version
        await self.engine.replace_policy(back)
        self.previous.pop()
        self.loaded_at = time.monotonic()
        return PolicyChange(old=old, new=back, version=self.engine.policy_version,
                            old_version=old_version, restored=back_version)

    def last_diff(self) -> str | None:
        """From the previous policy to the running one; None when nothing was replaced."""
        if not self.previous:
            return None
        return source_diff(self.previous[-1][0], self.engine.policy)

    def previous_version(self) -> int | None:
        """The version `last_diff` starts from; None when nothing was replaced."""
        return self.previous[-1][1] if self.previous else None

    def running_s(self) -> float:
        return time.monotonic() - self.loaded_at
