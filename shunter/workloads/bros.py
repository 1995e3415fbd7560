"""RT request lengths as BROS §7 runs them (Table 2).

BROS draws RT requests from ShareGPT (mean prompt 222.76, output 234.51 tokens) and LMSYS-Chat-1M
(90.50, 237.04). The ShareGPT table shared here (`../shared/traces`, etalon's 8k-filtered
stats) holds whole conversations (mean prompt 2,340, output 439), far longer, and no LMSYS data
could be brought here. So:

- `sharegpt-bros` FILTERS the shared ShareGPT table to rows with prompt <= 612 and output <= 500
  tokens: 4,961 of 30,731 rows, mean prompt 222.7 and output 233.7 (Table 2: 222.76, 234.51);
  the filter cuts the tails, so the spreads are narrower (std 190 and 152 against 256 and 268).
- `lmsys-bros` FITS a log-normal to Table 2's LMSYS-Chat-1M moments (prompt mean 90.50, std
  148.52; output 237.04, 228.21) and draws 10,000 seeded rows from it: synthetic lengths with the
  paper's means and spreads (drawn: 92.2 and 236.1, std 150 and 223), no real prompts.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from shunter.workloads.traces import read_length_table

SHAREGPT_MAX_PROMPT = 612
SHAREGPT_MAX_OUTPUT = 500
LMSYS_PROMPT = (90.50, 148.52)
LMSYS_OUTPUT = (237.04, 228.21)
"""(mean, std) of BROS Table 2's RT-LMSYS-CHAT-1M row."""


def sharegpt_table2(traces_dir: Path) -> list[tuple[int, int]]:
    return [(p, o) for p, o in read_length_table(traces_dir, "sharegpt")
            if p <= SHAREGPT_MAX_PROMPT and o <= SHAREGPT_MAX_OUTPUT]


def lognormal_draw(rng: random.Random, mean: float, std: float) -> int:
    sigma2 = math.log(1.0 + (std / mean) ** 2)
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))))


def lmsys_table2(rows: int = 10_000, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(f"lmsys-bros/{seed}")
    return [(lognormal_draw(rng, *LMSYS_PROMPT), lognormal_draw(rng, *LMSYS_OUTPUT))
            for _ in range(rows)]


def bros_table(name: str, traces_dir: Path) -> list[tuple[int, int]]:
    return sharegpt_table2(traces_dir) if name == "sharegpt-bros" else lmsys_table2()
