"""`shunter.Client` over HTTP, under asyncio and trio: the tokens of the in-process engine, the
same exception types, an early close that cancels and frees the blocks; a test double for what
the real server rarely sends (mid-stream errors, a cut stream, another server's chunks); and
`shunter bench --backend http` against a live sim server with policies swapped between runs."""

from __future__ import annotations

import json
import socket

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shunter import (
    Client, ConnectionLostError, Engine, EngineConfig, EngineDeadError, InvalidRequestError,
    PromptTooLongError, QueueFullError, RequestFailedError, RequestTooLongError, SamplingParams,
    SchedulingParams, UnauthorizedError,
)
from shunter.benchmark.policies import parse_policy
from shunter.benchmark.run import report_json, run_one
from shunter.cli import main
from shunter.remote import completion_body, error_from
from shunter.server import ServerSettings, build_app
from shunter.server.errors import CODES
from shunter.server.serve import serve_app
from shunter.workloads import load_workload
from tests.shunter.server.conftest import TEST_ROUTES, serving, tiny_config
from tests.shunter.test_workloads import traces  # noqa: F401  (fixture)

SIM = EngineConfig(backend="sim", block_size=16, max_num_seqs=8)


def _joined(chunks) -> tuple[tuple[int, ...], str]:
    return sum((c.token_ids for c in chunks), ()), "".join(c.text for c in chunks)


# ------------------------------------------------------------------ against the real server

@pytest.mark.anyio
async def test_a_streamed_text_prompt_gives_the_in_process_tokens_and_a_timeline(
        tiny_servers, tiny_llama_dir):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    async with Engine.start(tiny_config(tiny_llama_dir)) as engine:
        local = await engine.complete("hello world", params)
    async with Client(tiny_servers.url("asyncio")) as client:
        chunks = [c async for c in client.generate("hello world", params)]
    assert _joined(chunks) == (local.token_ids, local.text)
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    t = chunks[-1].timeline
    assert (t.output_tokens, t.prompt_tokens, t.finish_reason) == (8, local.timeline.prompt_tokens,
                                                                    "length")
    assert t.arrival < t.token_times[0] and list(t.token_times) == sorted(t.token_times)
    assert t.token_times[-1] <= t.finished_at and t.ttft_s > 0


@pytest.mark.anyio
async def test_token_id_prompts_sampling_and_stops_match_in_process(tiny_servers, tiny_llama_dir):
    prompt = [5, 17, 42, 99, 7]
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=7,
                            ignore_eos=True)
    async with Engine.start(tiny_config(tiny_llama_dir)) as engine:
        local = await engine.complete(prompt, greedy)
        stop = SamplingParams(max_tokens=10, stop_token_ids=(local.token_ids[3],))
        want = [local, await engine.complete(prompt, seeded), await engine.complete(prompt, stop)]
    async with Client(tiny_servers.url("asyncio"), model="tiny") as client:
        got = [await client.complete(prompt, p) for p in (greedy, seeded, stop)]
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == [
        (w.token_ids, w.text, w.finish_reason) for w in want]
    assert got[2].finish_reason == "stop" and got[0].timeline.prompt_tokens == len(prompt)


@pytest.mark.anyio
async def test_refusals_raise_the_in_process_exception_and_message(tiny_servers, tiny_llama_dir):
    too_long = [3] * 5000
    async with Engine.start(tiny_config(tiny_llama_dir)) as engine:
        with pytest.raises(PromptTooLongError) as local:
            await engine.complete(too_long)
    url = tiny_servers.url("asyncio")
    async with Client(url) as client:
        with pytest.raises(PromptTooLongError) as remote:
            await client.complete(too_long)
        assert str(remote.value) == str(local.value)
        running = await client.get_policy()
        with pytest.raises(InvalidRequestError) as unknown:
            await client.complete("hi", scheduling=SchedulingParams(request_class="gold"))
        assert str(unknown.value) == (f"unknown request_class 'gold': policy {running['name']} "
                                      f"declares {', '.join(running['classes'])}")
    async with Client(url, model="gpt-4") as client:
        with pytest.raises(InvalidRequestError, match="^model 'gpt-4' is not served here; "
                                                      "this server serves 'tiny'$"):
            async for _ in client.generate("hi"):
                pass


@pytest.mark.anyio
async def test_a_server_that_cannot_be_reached_is_a_lost_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with Client(f"http://127.0.0.1:{port}", model="m") as client:
        with pytest.raises(ConnectionLostError,
                           match=rf"^cannot reach the server at http://127.0.0.1:{port}: "):
            await client.complete([1, 2, 3])
    assert issubclass(ConnectionLostError, EngineDeadError)


@pytest.mark.anyio
async def test_api_key_and_a_full_queue():
    config = EngineConfig(backend="sim", max_queued_requests=1)
    async with serving(config, ServerSettings(api_key="sesame")) as served:
        async with Client(served.url) as client:
            with pytest.raises(UnauthorizedError, match="^a valid API key is needed"):
                await client.complete([1, 2])
        async with Client(served.url, "sesame") as client:
            async with client.generate([1, 2, 3], SamplingParams(max_tokens=500)) as first:
                await first.__anext__()
                with pytest.raises(QueueFullError, match="^the engine holds 1 requests, "
                                                         "max_queued_requests=1; retry later$"):
                    await client.complete([4, 5, 6])
            with anyio.fail_after(10):  # the first one, closed, is cancelled by the server
                await served.engine.wait_idle()
            assert (await client.complete([4, 5, 6], SamplingParams(max_tokens=2))).token_ids


@pytest.mark.anyio
async def test_leaving_the_loop_cancels_the_request_and_frees_its_blocks():
    async with serving(SIM) as served:
        reasons: list[str] = []
        served.app.state.on_finished.append(lambda chunk, reason, sched: reasons.append(reason))
        async with Client(served.url) as client:
            seen = 0
            async for chunk in client.generate(list(range(3, 200)), SamplingParams(max_tokens=5000)):
                seen += len(chunk.token_ids)
                if seen >= 2:
                    break
            async with client.generate([7] * 50, SamplingParams(max_tokens=5000)) as stream:
                await stream.__anext__()
            with anyio.fail_after(10):
                while len(reasons) < 2:
                    await anyio.sleep(0.01)
                snap = await served.engine.wait_idle()
        assert reasons == ["cancelled"] * 2 and snap.allocator.allocated_blocks == 0


# ------------------------------------------------------------------ against a test double

def _sse(*events: object) -> bytes:
    frames = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(frames).encode()


def _choice(text: str, finish: str | None = None, ids: list[int] | None = None) -> dict:
    choice: dict = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-x", "object": "text_completion", "choices": [choice]}


USAGE = {"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                  "total_tokens": 5}}
STREAMS = {
    "fails": _sse(_choice("a", ids=[1]), {"error": {"message": "boom", "type": "server_error",
                                                    "param": None, "code": "request_failed"}},
                  "[DONE]"),
    "dies": _sse(_choice("a", ids=[1]), {"error": {"message": "the scheduler actor failed",
                                                   "code": "engine_dead"}}, "[DONE]"),
    "cut": _sse(_choice("a", ids=[1])),
    # another server that sends no token ids: one token per chunk, text split over events
    "plain": _sse(_choice("he"), _choice("llo", "length"), USAGE, "[DONE]"),
}


async def _double_completions(request: Request) -> Response:
    body = await request.json()
    prompt = body["prompt"]
    if prompt in STREAMS:
        return Response(STREAMS[prompt], media_type="text/event-stream")
    status = int(prompt)  # a refusal without Shunter's codes, as another server sends it
    return JSONResponse({"error": {"message": f"refused with {status}", "code": None}},
                        status_code=status)


DOUBLE = Starlette(routes=[
    Route("/v1/completions", _double_completions, methods=["POST"]),
    Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "double"}]})),
])


def _double_client() -> Client:
    return Client("http://double", transport=httpx.ASGITransport(app=DOUBLE))


@pytest.mark.anyio
async def test_streams_the_server_cuts_short_or_fails():
    async with _double_client() as client:
        chunks = [c async for c in client.generate("fails")]
        assert [(c.token_ids, c.finish_reason, c.error) for c in chunks] == [
            ((1,), None, None), ((), "error", "boom")]
        with pytest.raises(RequestFailedError, match=r"^request 1 failed: boom$"):
            await client.complete("fails")
        with pytest.raises(EngineDeadError, match="^the scheduler actor failed$"):
            await client.complete("dies")
        with pytest.raises(ConnectionLostError, match=r"^the server at http://double ended "
                                                      r"request 3's stream before it finished$"):
            await client.complete("cut")


@pytest.mark.anyio
async def test_a_server_without_token_ids_is_timed_one_token_per_chunk():
    async with _double_client() as client:
        done = await client.complete("plain")
    assert (done.text, done.token_ids, done.finish_reason) == ("hello", (), "length")
    assert (done.timeline.output_tokens, done.timeline.prompt_tokens) == (2, 3)


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "error"), [
    (400, InvalidRequestError), (401, UnauthorizedError), (404, InvalidRequestError),
    (429, QueueFullError), (500, RequestFailedError), (503, EngineDeadError)])
async def test_refusals_of_other_servers_map_by_status(status, error):
    async with _double_client() as client:
        with pytest.raises(error, match=f"^refused with {status}$"):
            await client.complete(str(status))


def test_every_code_the_server_sends_maps_to_an_exception():
    expected = {"prompt_too_long": PromptTooLongError, "request_too_long": RequestTooLongError,
                "queue_full": QueueFullError,
                "engine_dead": EngineDeadError, "unauthorized": UnauthorizedError,
                "request_failed": RequestFailedError, "internal_error": RequestFailedError}
    for code in CODES:
        exc = error_from(400, {"error": {"message": "m", "code": code}}, "fallback")
        assert type(exc) is expected.get(code, InvalidRequestError), code
        assert str(exc) == "m"


def test_the_request_body_sends_only_what_differs_from_the_defaults():
    params = SamplingParams(max_tokens=5, temperature=0.5, seed=3, stop=("\n",), ignore_eos=True)
    sched = SchedulingParams(priority=2, request_class="rt", ttft_ms=300.0)
    body = completion_body([1, 2], params, sched, model="m", extensions=True)
    assert body == {
        "model": "m", "prompt": [1, 2], "max_tokens": 5, "temperature": 0.5, "top_p": 1.0,
        "seed": 3, "stop": ["\n"], "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "priority": 2, "request_class": "rt", "ttft_ms": 300.0}
    plain = completion_body("hi", SamplingParams(), sched, model=None, extensions=False)
    assert set(plain) == {"prompt", "max_tokens", "temperature", "top_p", "stream",
                          "stream_options", "return_token_ids"}


# ------------------------------------------------------------------ shunter bench --backend http

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_bench_over_http_replays_the_workload_with_the_sim_runs_json(
        anyio_backend, traces, tmp_path):  # noqa: F811
    spec = "mooncake-conv:rate=20x"  # a later turn waits for its parent's answer (token ids)
    out = tmp_path / "http.json"
    async with Engine.start(SIM) as engine:
        app = build_app(engine, extra_routes=TEST_ROUTES)  # the admin routes come with it
        async with anyio.create_task_group() as tg:
            url = await tg.start(serve_app, app)
            argv = ["bench", "--backend", "http", "--url", url, "--workload", spec, "--quiet",
                    "--traces", str(traces), "--policy", "fcfs", "--policy", "priority",
                    "--policy", "fcfs@max_num_seqs=2", "--json", str(out)]
            rc = await anyio.to_thread.run_sync(main, argv)
            policy_now = engine.policy.settings.name
            tg.cancel_scope.cancel()
    assert rc == 1 and policy_now == "priority"
    got = json.loads(out.read_text())
    workload = load_workload(spec, traces_dir=traces)
    in_process = await anyio.to_thread.run_sync(
        lambda: run_one(parse_policy("fcfs"), workload, SIM, progress=False))
    sim = report_json(workload, SIM, [in_process])
    assert set(got) == set(sim) - {"profile"} | {"url", "model"} and got["model"] == "sim"
    fcfs, priority, refused = got["runs"]
    assert refused["error"] == ("PolicyError: --policy 'fcfs@max_num_seqs=2': engine settings "
                                "(max_num_seqs) cannot change on a running server")
    for run in (fcfs, priority):
        assert set(run) == set(sim["runs"][0]) - {"timeseries"}
        assert set(run["metrics"]) == set(sim["runs"][0]["metrics"])
        assert run["metrics"]["requests"] == {"completed": len(workload.requests), "failed": 0}
    assert fcfs["engine"]["shunter_extensions"] is True
