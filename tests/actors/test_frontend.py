"""The frontend actor alone: submissions, cancellations and step outputs pushed into its inbox;
what each client's stream receives and what the scheduler is sent."""

from __future__ import annotations

import anyio
import attrs
import pytest
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.frontend import Frontend, Limits, TextCodec
from engine.messages import (
    AbortRequest,
    AddRequest,
    Cancel,
    FrontendMessage,
    SchedulerMessage,
    StepOutputs,
    Submit,
    TokenOutput,
)
from engine.outputs import Admitted, ClientOutput, Rejected
from shunter import (
    GenerationChunk,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    RequestTimeline,
    SamplingParams,
    SchedulingParams,
)
from tests.actors.inbox import nothing_waiting, receive
from tests.fakes import CharCodec

pytestmark = pytest.mark.trio

CODEC = CharCodec()
LIMITS = Limits(vocab_size=200, max_prompt_tokens=8, pool_tokens=128, max_queued_requests=3,
                max_context=256, block_size=16,
                eos_token_ids=(0,))


@attrs.define
class Wired:
    inbox: MemoryObjectSendStream[FrontendMessage]
    scheduler: MemoryObjectReceiveStream[SchedulerMessage]


async def start_frontend(nursery: trio.Nursery, limits: Limits = LIMITS,
                         codec: TextCodec | None = CODEC) -> Wired:
    inbox_send, inbox = anyio.create_memory_object_stream[FrontendMessage](16)
    scheduler, scheduler_recv = anyio.create_memory_object_stream[SchedulerMessage](16)
    actor = Frontend(codec=codec, limits=limits, inbox=inbox, scheduler=scheduler)
    await nursery.start(actor.run)
    return Wired(inbox=inbox_send, scheduler=scheduler_recv)


@pytest.fixture
async def front(nursery: trio.Nursery) -> Wired:
    return await start_frontend(nursery)


async def submit(front: Wired, prompt: str | None = None, prompt_ids: list[int] | None = None, *,
                 stream: bool = True, **sampling: object
                 ) -> MemoryObjectReceiveStream[ClientOutput]:
    """Submit like the Engine does; returns the client's stream."""
    send, recv = anyio.create_memory_object_stream[ClientOutput](float("inf"))
    await front.inbox.send(Submit(
        prompt=prompt, prompt_ids=prompt_ids, sampling=SamplingParams(**sampling),
        scheduling=SchedulingParams(), outputs=send, stream=stream))
    return recv


async def admitted(front: Wired, prompt: str, **sampling: object
                   ) -> tuple[int, MemoryObjectReceiveStream[ClientOutput]]:
    client = await submit(front, prompt, **sampling)
    answer = await receive(client)
    assert isinstance(answer, Admitted)
    assert isinstance(await receive(front.scheduler), AddRequest)
    return answer.request_id, client


async def outputs(front: Wired, *outs: TokenOutput) -> None:
    await front.inbox.send(StepOutputs(time=trio.current_time(), outputs=outs))


def tokens(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


async def rejection(client: MemoryObjectReceiveStream[ClientOutput]) -> Exception:
    answer = await receive(client)
    assert isinstance(answer, Rejected)
    with pytest.raises(anyio.EndOfStream):
        await receive(client)
    return answer.error



# ------------------------------------------------------------------------------ admission


async def test_a_submission_is_admitted_and_added_to_the_scheduler(front, autojump_clock):
    began = trio.current_time()
    await trio.sleep(5)
    client = await submit(front, "hi", max_tokens=3)
    assert await receive(client) == Admitted(request_id=1)
    assert await receive(front.scheduler) == AddRequest(
        request_id=1, prompt_ids=[ord("h"), ord("i")], sampling=SamplingParams(max_tokens=3),
        scheduling=SchedulingParams(), arrival=began + 5, eos_token_ids=(0,))
    second = await submit(front, prompt_ids=[5, 6])
    assert await receive(second) == Admitted(request_id=2)
    assert (await receive(front.scheduler)).prompt_ids == [5, 6]


async def test_a_prompt_over_max_prompt_tokens_is_rejected(front, autojump_clock):
    error = await rejection(await submit(front, "123456789"))
    assert type(error) is PromptTooLongError
    assert str(error) == "prompt has 9 tokens, more than max_prompt_tokens=8"
    assert nothing_waiting(front.scheduler)


async def test_a_prompt_the_kv_pool_cannot_hold_is_rejected(nursery, autojump_clock):
    front = await start_frontend(nursery, attrs.evolve(LIMITS, pool_tokens=4))
    error = await rejection(await submit(front, "abcd"))
    assert type(error) is PromptTooLongError
    assert str(error) == "prompt has 4 tokens; the KV pool holds only 4 tokens"


@pytest.mark.parametrize(("prompt", "prompt_ids", "message"), [
    ("ab", [1, 2], "give exactly one of prompt (text) or prompt_ids"),
    (None, None, "give exactly one of prompt (text) or prompt_ids"),
    ("", None, "the prompt is empty"),
    (None, [1, 200], "prompt_ids holds 200, outside the vocabulary [0, 200)"),
])
async def test_malformed_prompts_are_rejected(front, autojump_clock, prompt, prompt_ids, message):
    error = await rejection(await submit(front, prompt, prompt_ids))
    assert type(error) is InvalidRequestError and str(error) == message
    assert nothing_waiting(front.scheduler)


async def test_text_needs_a_tokenizer(nursery, autojump_clock):
    front = await start_frontend(nursery, codec=None)
    error = await rejection(await submit(front, "hi"))
    assert type(error) is InvalidRequestError
    assert str(error) == "this engine has no tokenizer; send prompt_ids"


async def test_a_full_queue_refuses_until_a_request_ends(front, autojump_clock):
    for _ in range(3):
        await admitted(front, "a")
    error = await rejection(await submit(front, "b"))
    assert type(error) is QueueFullError
    assert str(error) == "the engine holds 3 requests, max_queued_requests=3; retry later"
    await outputs(front, TokenOutput(request_id=2, token_ids=(), finish_reason="cancelled"))
    rid, _ = await admitted(front, "c")
    assert rid == 4


# ------------------------------------------------------------------------------ streaming


async def test_outputs_become_chunks_and_the_last_ends_the_stream(front, autojump_clock):
    rid, client = await admitted(front, "q")
    timeline = RequestTimeline(
        request_id=rid, request_class="be", tenant="t", conversation_id=None, prompt_tokens=1,
        arrival=0.0, first_scheduled=0.5, token_times=(0.5, 0.6, 0.6), finished_at=0.6,
        finish_reason="length")
    await outputs(front, TokenOutput(request_id=rid, token_ids=tokens("ab")))
    await outputs(front, TokenOutput(request_id=rid, token_ids=tokens("c"), finish_reason="length",
                                     metrics=timeline))
    assert await receive(client) == GenerationChunk(request_id=rid, token_ids=tokens("ab"),
                                                     text="ab")
    assert await receive(client) == GenerationChunk(
        request_id=rid, token_ids=tokens("c"), text="c", finish_reason="length",
        timeline=timeline)
    with pytest.raises(anyio.EndOfStream):
        await receive(client)


async def test_an_error_reaches_the_client_on_its_last_chunk(front, autojump_clock):
    rid, client = await admitted(front, "q")
    await outputs(front, TokenOutput(request_id=rid, token_ids=(), finish_reason="error",
                                     error="step failed: ValueError: boom"))
    chunk = await receive(client)
    assert (chunk.finish_reason, chunk.error) == ("error", "step failed: ValueError: boom")


async def test_a_non_streaming_client_gets_everything_in_the_final_chunk(front, autojump_clock):
    client = await submit(front, "q", stream=False)
    rid = (await receive(client)).request_id
    await receive(front.scheduler)
    await outputs(front, TokenOutput(request_id=rid, token_ids=tokens("ab")))
    await outputs(front, TokenOutput(request_id=rid, token_ids=tokens("cd"), finish_reason="stop"))
    chunk = await receive(client)
    assert (chunk.token_ids, chunk.text, chunk.finish_reason) == (tokens("abcd"), "abcd", "stop")
    with pytest.raises(anyio.EndOfStream):
        await receive(client)


async def test_a_stop_string_cuts_the_text_and_aborts_the_request(front, autojump_clock):
    rid, client = await admitted(front, "q", stop=("XY",))
    await outputs(front, TokenOutput(request_id=rid, token_ids=tokens("abX")))
    # "X" may start the stop string: held back until the next token decides
    assert (await receive(client)).text == "ab"
    await outputs(front, TokenOutput(request_id=rid, token_ids=tokens("Yz")))
    assert (await receive(client)).text == ""
    assert await receive(front.scheduler) == AbortRequest(request_id=rid, reason="stop")
    await outputs(front, TokenOutput(request_id=rid, token_ids=(), finish_reason="stop"))
    final = await receive(client)
    assert (final.text, final.finish_reason) == ("", "stop")


async def test_outputs_of_unknown_requests_are_ignored(front, autojump_clock):
    await outputs(front, TokenOutput(request_id=99, token_ids=(5,), finish_reason="length"))
    rid, client = await admitted(front, "q")
    await outputs(front, TokenOutput(request_id=rid, token_ids=(5,)))
    assert (await receive(client)).token_ids == (5,)


# ---------------------------------------------------------------------------- cancellation


async def test_cancel_aborts_the_request_once(front, autojump_clock):
    rid, _ = await admitted(front, "q")
    await front.inbox.send(Cancel(request_id=rid))
    await front.inbox.send(Cancel(request_id=rid))
    await front.inbox.send(Cancel(request_id=42))
    assert await receive(front.scheduler) == AbortRequest(request_id=rid, reason="cancelled")
    await trio.sleep(1)
    assert nothing_waiting(front.scheduler)


async def test_a_client_that_went_away_has_its_request_cancelled(front, autojump_clock):
    rid, client = await admitted(front, "q")
    client.close()
    await outputs(front, TokenOutput(request_id=rid, token_ids=(5,)))
    assert await receive(front.scheduler) == AbortRequest(request_id=rid, reason="cancelled")
    await outputs(front, TokenOutput(request_id=rid, token_ids=(6,)))
    await trio.sleep(1)
    assert nothing_waiting(front.scheduler)


async def test_when_the_inbox_closes_every_client_stream_ends(front, autojump_clock):
    _, client = await admitted(front, "q")
    await front.inbox.aclose()
    with pytest.raises(anyio.EndOfStream):
        await receive(client)


async def test_a_client_gone_before_its_submission_is_read_is_skipped(front, autojump_clock):
    """An HTTP client can hang up while its Submit waits in the inbox: the frontend must
    neither admit it nor fail (it once died sending Admitted to a closed stream)."""
    gone = await submit(front, "hi")
    gone.close()
    refused = await submit(front, "123456789")
    refused.close()
    client = await submit(front, "ok")
    assert await receive(client) == Admitted(request_id=2)
    assert (await receive(front.scheduler)).request_id == 2
    assert nothing_waiting(front.scheduler)
