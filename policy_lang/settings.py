"""What each setting of a policy may be: the kinds and ranges of class, fairness, pattern and
adaptive-batch arguments, and the symbols each `memory { }` setting takes (the checker's,
policy_lang/check.py, and the compiler's tables; KunServe's group settings come from
engine/cluster/group_settings.py, which also says which runner honours them)."""

from __future__ import annotations

import attrs

from engine.cluster.group_settings import GROUP_SETTINGS


@attrs.frozen(kw_only=True)
class Param:
    kind: str
    """number, whole, share (0..1, or a percentage), duration, symbol, tokens (whole tokens)"""
    default: object = None
    minimum: float = 0.0
    symbols: tuple[str, ...] = ()


CLASS_SETTINGS = {"ttft": Param(kind="duration"), "tpot": Param(kind="duration"),
                  "max_running": Param(kind="whole", minimum=1),
                  "max_queued": Param(kind="whole", minimum=1)}
FAIR_SETTINGS = {"input": Param(kind="number", default=1.0),
                 "output": Param(kind="number", default=1.0)}
PATTERNS = {"markov": {"stay": Param(kind="share", default=0.8),
                       "seed": Param(kind="whole", default=0)},
            "random": {"seed": Param(kind="whole", default=0)}}
ADAPTIVE = {"start": Param(kind="whole", default=8, minimum=1),
            "grow": Param(kind="whole", default=1),
            "max": Param(kind="whole", default=None, minimum=1),
            "reset_on": Param(kind="symbol", default="violation",
                              symbols=("violation", "predicted", "observed"))}
MEMORY = {"swap_granularity": ("per-block", "groups"), "swap_in": ("sync", "async", "adaptive"),
          "kv_reuse": ("on", "off"), "turn_copies": ("on", "off"),
          "prefix_cache": ("on", "off"), "bidirectional": ("on", "off"), **GROUP_SETTINGS}
PREEMPT_MODES = ("swap", "recompute", "never")
OVERLOAD_ACTIONS = ("drop", "restore")
