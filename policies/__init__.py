"""The policy library: `.policy` files shipped with Shunter (see each file's header for the paper
section it follows)."""

from __future__ import annotations

import difflib
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


def find_policy(spec: str | Path, option: str = "") -> Path:
    """The policy `spec` names: a file as given, else the shipped policy of that name. Raises
    PolicyError naming `option` (`--policy`) and `spec`, with the nearest shipped name."""
    path = Path(spec)
    if path.is_file():
        return path
    if len(path.parts) == 1 and not path.suffix and (policy_dir() / f"{path.name}.policy").is_file():
        return policy_dir() / f"{path.name}.policy"
    where = f"{option} {spec}" if option else str(spec)
    if path.is_dir():
        raise PolicyError(f"{where}: is a directory, not a policy file")
    near = difflib.get_close_matches(path.stem, available(), n=1)
    hint = f"; did you mean {near[0]}?" if near else ";"
    raise PolicyError(f"{where}: no such policy file or shipped policy{hint} "
                      f"shipped: {', '.join(available())}")
