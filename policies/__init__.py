"""The policy library: `.policy` files shipped with Shunter (see each file's header for the paper
section it follows)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from engine.errors import PolicyError


def policy_dir() -> Path:
    return Path(str(resources.files("policies")))


def available() -> list[str]:
    """Names of the shipped policies (fragments included)."""
    return sorted(p.stem for p in policy_dir().glob("*.policy"))


def policy_path(name: str) -> Path:
    """The shipped policy file called `name` (`fcfs`, `bros`, ...)."""
    path = policy_dir() / f"{name}.policy"
    if not path.is_file():
        raise PolicyError(f"no shipped policy named {name!r} (there are: {', '.join(available())})")
    return path
