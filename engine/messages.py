"""Typed messages between actors, grouped by the actor that receives them.

Commands are imperative (`AddRequest`, `RunStep`), events are past tense (`StepFinished`).
Messages carry ids and numbers, never tensors; one iteration costs O(1) messages: the scheduler
sends one `RunStep` to the allocator, which sends one `ExecuteStep` to the executor, which answers
the scheduler with one `StepFinished` and the frontend gets one `StepOutputs`. An iteration that
swaps goes allocator -> swap pool (`SwapOrders`, all its copies) -> executor; the pool reports
finished asynchronous swap-ins to the scheduler with `SwapDone`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import attrs
from anyio.streams.memory import MemoryObjectSendStream

from engine.cluster.group_messages import HandOverStreams, Regroup, TakeOverStreams
from engine.iteration_log import IterationLog, SwapCounters
from engine.outputs import ClientOutput
from engine.params import SamplingParams, SchedulingParams
from engine.policy import Policy, SwapGranularity
from engine.reply import Reply
from engine.snapshots import AllocatorSnapshot, SchedulerSnapshot
from engine.timeline import RequestTimeline

SwapDirection = Literal["out", "in", "move"]
"""`out`: device -> host (swap out); `in`: host -> device (swap in); `move`: device -> device,
only for slot copies (BROS's bidirectional blocks)."""

# ---------------------------------------------------------------------------------- frontend


@attrs.frozen(kw_only=True)
class Submit:
    """A client asks for a generation; `outputs` receives `Admitted`/`Rejected`, then chunks."""

    prompt: str | None
    prompt_ids: Sequence[int] | None
    sampling: SamplingParams
    scheduling: SchedulingParams
    outputs: MemoryObjectSendStream[ClientOutput]
    """The send side of the client's unbounded output stream."""
    stream: bool = True
    """Send a chunk per iteration; False sends only the final chunk, holding every token and
    the whole text (far cheaper per token for clients that want the whole result)."""


@attrs.frozen(kw_only=True)
class Cancel:
    """The client gave up on a request (left the loop, was cancelled, or disconnected)."""

    request_id: int


class TokenOutput(NamedTuple):
    """New tokens of one request in one iteration (a named tuple, as `SeqWork`)."""

    request_id: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """`stop`, `length`, `cancelled` or `error` on the request's last output."""
    error: str | None = None
    metrics: RequestTimeline | None = None
    """The request's timings, on its last output."""


@attrs.frozen(kw_only=True)
class StepOutputs:
    """Everything one iteration produced for clients, in one message."""

    time: float
    outputs: tuple[TokenOutput, ...]


FrontendMessage = Submit | Cancel | StepOutputs | HandOverStreams | TakeOverStreams

# --------------------------------------------------------------------------------- scheduler


@attrs.frozen(kw_only=True)
class AddRequest:
    """An admitted request enters the scheduler's waiting queue."""

    request_id: int
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    scheduling: SchedulingParams
    arrival: float
    eos_token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class AbortRequest:
    """End a request early: a cancelled client (`cancelled`) or a stop string seen (`stop`)."""

    request_id: int
    reason: str


class SampledToken(NamedTuple):
    request_id: int
    token_id: int


@attrs.frozen(kw_only=True)
class StepFinished:
    """The executor ran a step; one token for each sequence that asked to sample."""

    step_id: int
    sampled: tuple[SampledToken, ...]
    compute_s: float
    """Seconds the forward pass and sampling took (on the device thread or simulated)."""
    stall_s: float = 0.0
    """Seconds the step waited for swaps first: synchronous swap-ins, and swap-outs still
    reading blocks this step writes (conflicts)."""


@attrs.frozen(kw_only=True)
class SwapDone:
    """Asynchronous swap-ins finished: those requests' KV is on the device (FastSwitch §3.2).
    `failed` lists requests whose copies (in either direction) raised, with the error; a
    request listed there may also have ended already (a conversation turn whose KV was being
    kept)."""

    request_ids: tuple[int, ...]
    seconds_per_block: float | None = None
    """Mean time a block of these swap-ins took, from dispatch to completion (the adaptive
    swap-in profiler's input)."""
    failed: tuple[int, ...] = ()
    error: str | None = None


@attrs.frozen(kw_only=True)
class StepFailed:
    """The step raised; every request in it ends with finish reason `error`."""

    step_id: int
    error: str
    kv_lost: bool = False
    """KunServe: the runner lost every request's KV (its pipeline group lost a member, and it
    serves alone again): every live request is recomputed instead (engine/cluster/adoption.py)."""
    pool_blocks: int | None = None
    """With `kv_lost`: the runner's own pool, which the engine's shrinks back to."""


@attrs.frozen(kw_only=True)
class InspectScheduler:
    """Ask for a snapshot of the scheduler's queues (tests, the REPL, `/metrics`)."""

    reply: Reply[SchedulerSnapshot]


@attrs.frozen(kw_only=True)
class TakeIterationLog:
    """Hand over the per-iteration log (an `engine.iteration_log.IterationLog`, or None when
    `record_iterations` is off) and start a new one."""

    reply: Reply[IterationLog | None]


@attrs.frozen(kw_only=True)
class ReplacePolicy:
    """Switch to another compiled policy at the next iteration boundary."""

    policy: Policy
    version: int
    """Its version: 1 was the policy the engine started with; the Engine numbers them."""
    reply: Reply[None]


SchedulerMessage = (
    AddRequest | AbortRequest | StepFinished | StepFailed | SwapDone | InspectScheduler
    | ReplacePolicy | TakeIterationLog | Regroup
)

# --------------------------------------------------------------------------------- allocator


class SeqWork(NamedTuple):
    """One sequence's share of a step: compute tokens [start, start + num_tokens). A named
    tuple, like the other per-sequence messages: several are built per sequence per iteration,
    and a tuple is built faster than a frozen attrs class."""

    request_id: int
    start: int
    num_tokens: int
    sample: bool
    """Sample a token after this step (the last known token is being processed)."""

    def written(self, block_size: int) -> slice:
        """The entries of the request's block table this step writes KV into."""
        return slice(self.start // block_size, (self.start + self.num_tokens - 1) // block_size + 1)


@attrs.frozen(kw_only=True)
class RequestSetup:
    """What the executor keeps for a request it has not seen before."""

    request_id: int
    prompt_ids: Sequence[int]
    """The tokens to set up: the prompt, and for a request set up again after it produced
    tokens (KunServe: moved here, or recomputed after its group lost a member) its output so
    far too (engine/step_plan.py)."""
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class SwapOut:
    """Copy blocks [first_block, first_block + len(cpu_blocks)) of a request's block table to
    these host blocks, then free its device blocks. Blocks before `first_block` are already
    held by a valid CPU copy (FastSwitch §3.3) and are not copied again."""

    request_id: int
    first_block: int
    cpu_blocks: tuple[int, ...]


@attrs.frozen(kw_only=True)
class SwapIn:
    """Allocate device blocks for a request that holds none and copy these host blocks in."""

    request_id: int
    cpu_blocks: tuple[int, ...]
    sync: bool
    """The step waits for it (the request computes in this step); else it is reported by
    `SwapDone` and joins a later step."""


@attrs.frozen(kw_only=True)
class PrefixOps:
    """What the scheduler's prefix cache (engine/memory/prefix_cache.py) changed since the last
    step, for the allocator to map onto block ids, in this order: `publish` before anything is
    freed, `evict` after freeing, `attach` before any block is allocated."""

    publish: tuple[tuple[int, int, bytes], ...] = ()
    """(request_id, block index, key): that block of the request is now cached under key."""
    evict: tuple[bytes, ...] = ()
    """Keys no request holds whose blocks go back to the free list."""
    attach: tuple[tuple[int, tuple[bytes, ...]], ...] = ()
    """(request_id, keys): a request holding no blocks starts its table with these cached
    blocks (a prefix hit)."""


@attrs.frozen(kw_only=True)
class RunStep:
    """The scheduler's whole plan for one iteration, sent to the allocator.

    The allocator first frees, then gives every request in `block_targets` device blocks up to
    the given count, then forwards an `ExecuteStep` carrying the new block ids.
    """

    step_id: int
    release: tuple[int, ...]
    """Requests that end: their blocks go back, and the executor forgets them."""
    preempt: tuple[int, ...]
    """Requests preempted by recompute: their blocks go back; they keep their tokens."""
    block_targets: tuple[tuple[int, int], ...]
    """(request_id, device blocks it must hold after this step): a target count, not a
    growth; a request already holding as many gets none."""
    setups: tuple[RequestSetup, ...]
    seqs: tuple[SeqWork, ...]
    swap_out: tuple[SwapOut, ...] = ()
    """Done before anything is freed: preempted requests (listed in `preempt` too) and ended
    conversation turns whose KV is kept (listed in `release`)."""
    swap_in: tuple[SwapIn, ...] = ()
    """Done after freeing, before the block targets are met."""
    granularity: SwapGranularity = "per-block"
    """How the swap pool copies."""
    bidirectional: BidirectionalOrders | None = None
    """With BROS's bidirectional blocks (the scheduler's table places KV slot by slot): the
    allocator passes these on instead of allocating from its pool."""
    prefix: PrefixOps | None = None
    """Prefix cache changes; None when there are none."""
    pool_blocks: int | None = None
    """KunServe: the KV pool's new size in blocks (grown by freed weights, or back), applied
    before anything else; None: unchanged."""
    group: object | None = None
    """KunServe: the runner serves from this step as this `GroupPlan` (one member: alone)."""


@attrs.frozen(kw_only=True)
class BidirectionalOrders:
    """A step's bidirectional block table changes and its slot copies (BROS §5.2)."""

    blocks: tuple[BlockUpdate, ...]
    """Whole new tables (signed entries: `-b - 1` is block b filled right to left)."""
    transfers: tuple[SwapTransfer, ...]
    """Slot copies (`pairs` of flat slots), all done before the step computes, in this order."""


@attrs.frozen(kw_only=True)
class InspectAllocator:
    """Ask for the allocator's block usage and tables."""

    reply: Reply[AllocatorSnapshot]


AllocatorMessage = RunStep | InspectAllocator

# ---------------------------------------------------------------------------------- executor


@attrs.frozen(kw_only=True)
class BlockUpdate:
    """Change to one request's block table on the executor."""

    request_id: int
    reset: bool
    """Drop the current table first (the request was preempted by recompute)."""
    append: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ExecuteStep:
    step_id: int
    release: tuple[int, ...]
    setups: tuple[RequestSetup, ...]
    blocks: tuple[BlockUpdate, ...]
    seqs: tuple[SeqWork, ...]
    wait_tickets: tuple[int, ...] = ()
    """Swap tickets (synchronous swap-ins) that must complete before the step computes."""
    pool_blocks: int | None = None
    """KunServe: the pool's new size (the runner re-views its arena first); None: unchanged."""
    moves: tuple[tuple[int, int], ...] = ()
    """KunServe: (src, dst) block copies to do before the step (a shrunk pool's tail moved)."""
    group: object | None = None
    """KunServe: from this step, run as this `GroupPlan` (one member: alone); None: unchanged."""


ExecutorMessage = ExecuteStep

# --------------------------------------------------------------------------------- swap pool


@attrs.frozen(kw_only=True)
class SwapTransfer:
    """One request's copies in one direction: (device block, host block) pairs."""

    request_id: int
    direction: SwapDirection
    pairs: tuple[tuple[int, int], ...]
    sync: bool = False


@attrs.frozen(kw_only=True)
class SwapOrders:
    """One iteration's swaps, in one message; the pool dispatches them (returning at once) and
    forwards `step` to the executor, so the step always sees its own swaps."""

    transfers: tuple[SwapTransfer, ...]
    """Swap-outs before swap-ins: a swap-in may land on blocks a swap-out of the same step
    still reads, and the swapper orders a copy after the earlier ones sharing a block with it."""
    granularity: SwapGranularity
    step: ExecuteStep


@attrs.frozen(kw_only=True)
class TakeSwapCounters:
    """Hand over the swap traffic (copies, bytes, blocks, stall) since the last take and start
    counting afresh; the Engine adds it to the iteration log it takes from the scheduler."""

    reply: Reply[SwapCounters]


@attrs.frozen(kw_only=True)
class InspectSwapPool:
    """Ask for the swap traffic since the engine started, without resetting anything
    (`/metrics` reads it at every scrape; `TakeSwapCounters` keeps its own mark)."""

    reply: Reply[SwapCounters]


SwapPoolMessage = SwapOrders | TakeSwapCounters | InspectSwapPool
