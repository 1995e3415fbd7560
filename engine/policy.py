"""The seam between the scheduler (mechanism) and a scheduling policy (decisions).

Each iteration the scheduler hands the policy a `SchedulerView` and gets a `Decision` back: the
order in which live requests deserve the device, a batch-size limit, and whether a more
important waiting request may evict a less important running one. The scheduler then fits that
order to the memory and token budget it has; it never asks which policy it is running.

Policies written in the policy language (`policy_lang/`) compile to objects with this interface;
`FcfsPolicy` below is the hand-written equivalent of `policies/fcfs.policy`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Literal, NamedTuple, Protocol

import attrs

from engine.cluster.group_settings import group_unsupported
from engine.cost_model import CostModel
from engine.errors import PolicyError

RequestState = Literal["waiting", "running", "swapped", "swapping_in"]
PreemptMode = Literal["recompute", "swap", "never"]
OverloadSignal = Literal["drop", "restore"]
SwapGranularity = Literal["per-block", "groups", "slots"]
"""`per-block`: one copy per block per layer per K/V (vLLM 0.3.3); `groups`: one copy per run
of blocks consecutive on both sides (FastSwitch §3.1); `slots`: single KV slots, one strided copy
per run of them (BROS's lazy checkpointing; never written in a policy)."""


def token_deadline(arrival: float, ttft_ms: float | None, tpot_ms: float | None,
                   first_token_at: float | None, output_tokens: int) -> float:
    """When a request's next token is due (engine clock, seconds); inf without a deadline.
    Positional: called for every token a simulated hour delivers."""
    if first_token_at is None:
        return math.inf if ttft_ms is None else arrival + ttft_ms / 1000.0
    if tpot_ms is None:
        return math.inf
    return first_token_at + output_tokens * tpot_ms / 1000.0


class RequestView(NamedTuple):
    """One live request as a policy sees it at the start of one iteration: a frozen record of
    the scheduler's `engine.request.Request`, kept until the request changes (it holds nothing
    that depends on the clock: `waited_s(now)` and `slack_ms(now)` are computed from it). A
    named tuple, not an attrs class: a tuple is built five times faster (0.4 us against 2 us for
    23 fields), which the simulator's hour-long traces feel."""

    id: int
    request_class: str
    priority: int
    """Client-given priority (larger is more important)."""
    tenant: str
    conversation_id: str | None
    turn: int
    """1 for a conversation's first request, 2 for the next, ..."""
    arrival: float
    """Engine clock, seconds."""
    prompt_tokens: int
    max_tokens: int
    ttft_ms: float | None
    """Effective time-to-first-token deadline (request's own, else its class's)."""
    tpot_ms: float | None
    state: RequestState = "waiting"
    output_tokens: int = 0
    """Tokens generated so far."""
    computed_tokens: int = 0
    """Tokens whose KV is on the device."""
    blocks: int = 0
    """Device KV blocks held."""
    swapped_blocks: int = 0
    """KV blocks held in host swap space."""
    checkpointed_blocks: int = 0
    """Blocks checkpointed on the host (BROS's lazy checkpointing; 0 until it exists)."""
    preemptions: int = 0
    """Times it lost its device blocks (by swap or recompute)."""
    first_token_at: float | None = None
    """Engine clock when its first token was delivered."""
    last_token_at: float | None = None
    last_scheduled_at: float | None = None
    """Engine clock when a step it was in last finished."""
    deadline: float = math.inf
    """Engine clock when its next token is due; inf without a deadline (`token_deadline`)."""
    trace_id: str | None = None
    """`SchedulingParams.trace_id`: what periodic priority updates draw from."""
    cached_tokens: int = 0
    """A waiting request holding no KV: leading tokens of its context whose blocks the device
    prefix cache holds (it starts computing after them). 0 without `prefix_cache on`."""
    cached_idle_blocks: int = 0
    """Of those blocks, the ones no live request holds: taking them uses up free memory."""
    shared_blocks: int = 0
    """Blocks it holds that stay in use if it loses its blocks (another request holds them too,
    or a waiting request's cache hit wants them): preempting it frees `blocks` minus these."""

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def remaining_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.context_tokens - self.computed_tokens

    def waited_s(self, now: float) -> float:
        """Seconds since the request was last served (or arrived), at `now`."""
        return now - (self.last_scheduled_at or self.arrival)

    def slack_ms(self, now: float) -> float:
        """Milliseconds left until its next token is due, at `now`; inf without a deadline."""
        return (self.deadline - now) * 1000.0


@attrs.frozen(kw_only=True)
class SchedulerView:
    """What the scheduler knows at the start of an iteration."""

    now: float
    iteration: int
    requests: Sequence[RequestView]
    free_blocks: int
    total_blocks: int
    block_size: int
    max_num_seqs: int
    max_batched_tokens: int
    last_iteration_ms: float = 0.0
    cost: CostModel | None = None
    """Predicts an iteration's latency from its batch shape; None when the backend has none."""
    reverse_free_blocks: int | None = None
    """On BROS's bidirectional table (§5.2): the blocks a best-effort request (no TTFT or TPOT
    goal) may take, only wholly free ones, whereas `free_blocks` also counts the BE blocks an
    RT request may overwrite. None: every request may take `free_blocks`."""

    @property
    def kv_usage(self) -> float:
        """Fraction of device KV blocks in use, 0..1."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def free_tokens(self) -> int:
        return self.free_blocks * self.block_size

    @property
    def queued_tokens(self) -> int:
        """Tokens of requests that are not running and still need computing."""
        return sum(r.remaining_tokens for r in self.requests if r.state != "running")

    @property
    def pending_tokens(self) -> int:
        """KV tokens the running requests still need for their prompts."""
        return sum(max(0, r.prompt_tokens - r.computed_tokens) for r in self.requests
                   if r.state == "running")

    @property
    def head_tokens(self) -> int:
        """KV tokens the oldest waiting or swapped request needs to run."""
        return min(((r.arrival, r.context_tokens) for r in self.requests
                    if r.state in ("waiting", "swapped")), default=(0.0, 0))[1]


@attrs.frozen(kw_only=True)
class Decision:
    """A policy's answer for one iteration."""

    order: Sequence[RequestView]
    """Live requests, most deserving first. A request left out gets no work this iteration
    (it keeps what it holds unless memory is needed for requests in the order)."""
    max_batch: int | None = None
    """Most sequences in this iteration's batch; None leaves the engine's limit."""
    displace: bool = False
    """May a request in the order evict running requests that come after it (or are left out)."""
    batch: int | None = None
    """Only the first `batch` requests of the order may get work this iteration (a packed
    batch, BROS §4.2); the rest of the order only ranks running requests as preemption victims
    (the last first). None: every request in the order may get work."""
    overload: OverloadSignal | None = None
    """An overload trigger firing this iteration (KunServe §4.1, §4.4): `drop` asks for
    parameters to be dropped to free memory, `restore` for them to come back. Until the cluster
    coordinator exists the engine only counts and logs these."""


@attrs.frozen(kw_only=True)
class ClassSpec:
    """A request class and its service goals."""

    name: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_running: int | None = None
    max_queued: int | None = None


@attrs.frozen(kw_only=True)
class MemorySettings:
    """Memory mechanisms a policy runs with (one file per ablation step)."""

    swap_granularity: SwapGranularity = "per-block"
    swap_in: Literal["sync", "async", "adaptive"] = "sync"
    kv_reuse: bool = False
    turn_copies: bool = True
    """With `kv_reuse`: copy an ended conversation turn's KV to the host so the next turn swaps
    it in instead of prefilling it (FastSwitch §3.3). Off: only preemption copies are kept."""
    prefix_cache: bool = False
    """Full device KV blocks are cached by content and reused by later requests with the same
    prefix (vLLM's automatic prefix caching); per-block allocator only."""
    bidirectional: bool = False
    """BROS §5: RT and BE requests share blocks from opposite ends, RT overwriting BE slots
    after checkpointing them to the host (engine/memory/bidirectional.py); chosen at start."""
    kv_exchange: Literal["fifo", "coordinated"] = "fifo"
    """KunServe §4.2, once instances form groups: `fifo` sends a group's exchanged KV in one
    queue with the activations (they wait behind it); `coordinated` sends it in chunks and lets
    activations go first."""
    microbatch: Literal["tokens", "lookahead"] = "tokens"
    """KunServe §4.3, how a group's step is cut into microbatches: by token count, or by the
    attention-aware cost model over the whole lookahead window (engine/cluster/lookahead.py)."""
    restore_prefetch: bool = True
    """KunServe §4.4: a group's restore brings dropped weights and full KV blocks back while it
    serves (gpu/restore_prefetch.py); off: all at the restore's step, no step meanwhile."""
    restore_from: Literal["peer", "host"] = "peer"
    """Where a restore takes dropped weights from: the members keeping them, or host copies."""


@attrs.frozen(kw_only=True)
class PolicySettings:
    """The static part of a policy, read once when it is loaded."""

    name: str
    classes: tuple[ClassSpec, ...] = (ClassSpec(name="default"),)
    default_class: str = "default"
    preempt_mode: PreemptMode = "recompute"
    short_of_block: Literal["below", "self"] = "below"
    """Who is preempted when a running request lacks its next block: running requests ranked
    below it (engine/planner.py `make_room`), or itself (BROS §7.4.1's ablation)."""
    memory: MemorySettings = MemorySettings()
    dispatch: str = "round_robin"
    """A cluster's rule for which instance a new request goes to (`dispatch`, one of DISPATCH_RULES)."""
    prefill: Literal["mixed", "separate"] = "mixed"
    """`mixed`: prompts are chunked into the token budget beside decodes. `separate` (vLLM V0
    without chunked prefill): an iteration that takes prompts takes whole prompts and no
    decodes; otherwise it runs decodes (engine/planner.py, `_Planner.separate_phases`)."""
    token_budget: int | None = None
    """The policy's own tokens per iteration (`prefill separate(budget = N tokens)`), else the engine's."""
    prompt_watermark: float = 0.0
    """`prefill separate(watermark = 1%)`: a prompt is admitted only if this share of all blocks
    stays free after it (vLLM V0's BlockSpaceManager watermark, 0.01 by default)."""

    def class_spec(self, name: str | None) -> ClassSpec | None:
        wanted = name or self.default_class
        return next((c for c in self.classes if c.name == wanted), None)


@attrs.frozen(kw_only=True)
class IterationOutcome:
    """What an iteration did, fed back to the policy (fairness counters, adaptive batch size)."""

    iteration: int
    duration_ms: float
    served: Sequence[tuple[RequestView, int, int]]
    """(request, prompt tokens computed, output tokens produced) for each request served; the
    request as the policy saw it when it decided the iteration (views are frozen)."""
    deadline_misses: int
    """Tokens delivered after their deadline in this iteration."""


@attrs.frozen(kw_only=True)
class EngineCapabilities:
    """The mechanisms the running engine has. A policy that needs another is refused when it is
    loaded, naming the setting and what the engine was started with."""

    preempt_modes: frozenset[str] = frozenset({"recompute", "never"})
    swap_granularities: frozenset[str] = frozenset()
    """`per-block` and/or `groups`; empty when the engine cannot swap."""
    swap_in_modes: frozenset[str] = frozenset()
    """`sync`, `async`, `adaptive`; empty when the engine cannot swap."""
    kv_reuse: bool = False
    no_swap: str = "it has no swap space"
    """Why the engine cannot swap, said in the errors of a policy that needs swap (what the
    engine was started with)."""
    allocator: SwapGranularity | None = None
    """The granularity of the device allocator once the engine has chosen it (from the policy
    it starts with): a later policy that swaps, or writes `swap_granularity`, must match it."""
    bidirectional: bool | None = None
    """Whether the engine runs BROS's bidirectional block table, once chosen (from the policy
    it starts with); a later policy cannot turn it on."""
    bidirectional_swap: bool | None = None
    """The bidirectional table has a copy space for whole requests preempted by swap, once
    chosen (the policy the engine starts with has bidirectional on and preempt swap)."""
    group_modes: frozenset[str] = frozenset()
    """KunServe group settings its runner honours (engine/cluster/group_settings.py)."""
    no_overload: str | None = None
    """Why this engine (or cluster) cannot act on `overload` triggers; None when it can or
    when nothing acts on them anyway (a lone engine counts them)."""

    @property
    def swap(self) -> bool:
        return "swap" in self.preempt_modes

    def running(self, settings: PolicySettings) -> EngineCapabilities:
        """These capabilities once the device allocator follows `settings` (the policy the
        engine starts with)."""
        bidi = settings.memory.bidirectional
        return attrs.evolve(self, allocator=settings.memory.swap_granularity, bidirectional=bidi,
                            bidirectional_swap=bidi and settings.preempt_mode == "swap")

    def unsupported(self, settings: PolicySettings,
                    written: Collection[str] = ()) -> list[tuple[str, str]]:
        """(setting, why) for each setting this engine cannot honour. A memory setting counts
        when the policy swaps (and the engine can), when it is `written` explicitly, or when it
        differs from the default."""
        m, default = settings.memory, MemorySettings()
        swaps = settings.preempt_mode == "swap" and self.swap
        out = []
        if settings.preempt_mode not in self.preempt_modes:
            why = f"it supports: {', '.join(sorted(self.preempt_modes))}"
            if settings.preempt_mode == "swap":
                why = f"{why}; {self.no_swap}"
            out.append(("preempt", f"preempt {settings.preempt_mode} is not supported by this "
                                   f"engine ({why})"))

        def needed(name: str) -> bool:
            return swaps or name in written or getattr(m, name) != getattr(default, name)

        for name, value, have in (("swap_granularity", m.swap_granularity, self.swap_granularities),
                                  ("swap_in", m.swap_in, self.swap_in_modes)):
            if needed(name) and value not in have:
                built = f"it supports: {', '.join(sorted(have))}" if have else self.no_swap
                out.append((name, f"{name} {value} is not supported by this engine ({built})"))
        if (needed("swap_granularity") and m.swap_granularity in self.swap_granularities
                and self.allocator not in (None, m.swap_granularity)):
            out.append(("swap_granularity", f"swap_granularity {m.swap_granularity} does not "
                        f"match this engine's device allocator, which runs {self.allocator} (it "
                        f"follows the policy the engine started with; restart the engine to "
                        f"change it)"))
        if self.no_overload is not None and "overload" in written:
            out.append(("overload", f"overload triggers cannot act here: {self.no_overload}"))
        out += group_unsupported(m, self.group_modes, written)
        if m.prefix_cache and self.allocator == "groups":
            out.append(("prefix_cache", "prefix_cache on does not work with this engine's device "
                        "allocator, which runs block groups (it follows the policy the engine "
                        "started with; restart the engine with a per-block policy)"))
        if m.bidirectional and (not self.swap or self.bidirectional is False):
            why = (self.no_swap if not self.swap else "it started without it; restart the engine "
                   "with this policy") + "; BROS checkpoints overwritten slots to host memory"
            out.append(("bidirectional",
                        f"bidirectional on is not supported by this engine ({why})"))
        for name, bad, why in (
                ("bidirectional", swaps and self.bidirectional_swap is False, "bidirectional on "
                 "with preempt swap needs a host copy space the engine sets aside only when it "
                 "starts with such a policy: restart it with this one, or preempt recompute"),
                ("swap_in", swaps and m.swap_in != "sync", f"swap_in {m.swap_in} is not supported "
                 "with bidirectional on (a request swaps back in the step that needs it)")):
            if m.bidirectional and bad:
                out.append((name, why))
        if m.kv_reuse and not self.kv_reuse:
            why = "it keeps no CPU copies across turns" if self.swap else self.no_swap
            out.append(("kv_reuse", f"kv_reuse on is not supported by this engine ({why})"))
        return out


def ensure_supported(policy: Policy, capabilities: EngineCapabilities) -> None:
    """Raise PolicyError when `policy` needs a mechanism the engine lacks. Compiled policies
    point at the file, line and column of the setting."""
    check = getattr(policy, "check_supported", None)
    if check is not None:
        check(capabilities)
        return
    problems = capabilities.unsupported(policy.settings)
    if problems:
        reasons = "; ".join(why for _, why in problems)
        raise PolicyError(f"policy {policy.settings.name}: {reasons}")


class Policy(Protocol):
    settings: PolicySettings
    source: str
    """The text it was compiled from (shown, diffed and rolled back by the REPL)."""

    def decide(self, view: SchedulerView) -> Decision: ...

    def observe(self, outcome: IterationOutcome) -> None: ...


FCFS_SOURCE = "policy fcfs { }\n"


class FcfsPolicy:
    """First come, first served; preempt the latest arrival by recompute (vLLM's default)."""

    def __init__(self) -> None:
        self.settings = PolicySettings(name="fcfs")
        self.source = FCFS_SOURCE

    def decide(self, view: SchedulerView) -> Decision:
        order = sorted(view.requests, key=lambda r: (r.arrival, r.id))
        return Decision(order=order)

    def observe(self, outcome: IterationOutcome) -> None:
        pass
