"""Issue 12, item 2: a request whose prompt plus max_tokens can never fit the KV pool or the
model's context is refused at admission, saying which limit and by how much; one exactly at the
limit runs to max_tokens; one that asked for truncation ends with the limit's name, never `length`."""

from __future__ import annotations

import re

import httpx
import pytest

from shunter import Client, Engine, EngineConfig, RequestTooLongError, SamplingParams
from shunter.cli import main
from tests.fakes import expected_continuation, fake_backend
from tests.shunter.server.conftest import serving

pytestmark = pytest.mark.anyio

PROMPT = list(range(10, 47))  # 37 tokens
CONFIG = EngineConfig(block_size=16, max_num_seqs=4, max_batched_tokens=64)
POOL_MESSAGE = ("prompt (37 tokens) + max_tokens (100) = 137 tokens, but the KV pool holds 48 "
                "tokens (num_blocks=3 x block_size=16): 89 too many; lower max_tokens to at most "
                "11 or give the engine more blocks")
CONTEXT_MESSAGE = ("prompt (37 tokens) + max_tokens (100) = 137 tokens, but the model's context "
                   "is 128 tokens: 9 too many; lower max_tokens to at most 91 or shorten the prompt")


def pool_bound() -> object:
    """3 blocks of 16 tokens (48), a model context far larger."""
    return fake_backend(num_blocks=3, block_size=16)


def context_bound() -> object:
    """A 128-token context, a pool far larger."""
    return fake_backend(num_blocks=64, block_size=16, max_context=128)


@pytest.mark.parametrize(("backend", "message"), [(pool_bound, POOL_MESSAGE),
                                                  (context_bound, CONTEXT_MESSAGE)])
async def test_a_request_that_can_never_fit_is_refused_naming_the_limit(backend, message):
    async with Engine.start(CONFIG, backend=backend()) as engine:
        with pytest.raises(RequestTooLongError) as info:
            await engine.complete(PROMPT, SamplingParams(max_tokens=100))
        assert str(info.value) == message
        snap = await engine.wait_idle()
    assert snap.allocator.allocated_blocks == 0


@pytest.mark.parametrize(("backend", "fits"), [(pool_bound, 11), (context_bound, 91)])
async def test_a_request_exactly_at_the_limit_runs_to_max_tokens(backend, fits):
    async with Engine.start(CONFIG, backend=backend()) as engine:
        done = await engine.complete(PROMPT, SamplingParams(max_tokens=fits, ignore_eos=True))
        with pytest.raises(RequestTooLongError):
            await engine.complete(PROMPT, SamplingParams(max_tokens=fits + 1, ignore_eos=True))
    assert done.finish_reason == "length"
    assert list(done.token_ids) == expected_continuation(PROMPT, fits)


@pytest.mark.parametrize(("backend", "fits", "reason"), [(pool_bound, 11, "pool"),
                                                         (context_bound, 91, "context")])
async def test_a_truncated_request_ends_with_the_limit_as_its_reason(backend, fits, reason):
    async with Engine.start(CONFIG, backend=backend()) as engine:
        done = await engine.complete(
            PROMPT, SamplingParams(max_tokens=100, ignore_eos=True, truncate=True))
        snap = await engine.wait_idle()
    assert done.finish_reason == reason
    assert list(done.token_ids) == expected_continuation(PROMPT, fits)
    assert snap.allocator.allocated_blocks == 0


@pytest.mark.parametrize(("backend", "message"), [(pool_bound, POOL_MESSAGE),
                                                  (context_bound, CONTEXT_MESSAGE)])
async def test_over_http_the_refusal_is_a_400_request_too_long(backend, message):
    async with serving(CONFIG, backend=backend()) as s:
        async with httpx.AsyncClient(base_url=s.url) as http:
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})
            assert r.status_code == 400
            assert r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                         "param": "max_tokens", "code": "request_too_long"}
            ok = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 11,
                                                          "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        async with Client(s.url) as client:
            with pytest.raises(RequestTooLongError) as info:
                await client.complete(PROMPT, SamplingParams(max_tokens=100))
            assert str(info.value) == message


def test_the_cli_exits_2_with_the_one_line_message(tiny_llama_dir, capsys):
    code = main(["generate", "--model", str(tiny_llama_dir), "--num-blocks", "3",
                 "--max-tokens", "100", "--prompt", "the quick brown fox jumps over the lazy dog"])
    err = capsys.readouterr().err
    assert code == 2
    found = re.match(r"shunter generate: prompt \((\d+) tokens\)", err)
    assert found, err
    n = int(found.group(1))
    assert err == (f"shunter generate: prompt ({n} tokens) + max_tokens (100) = {n + 100} tokens, "
                   f"but the KV pool holds 48 tokens (num_blocks=3 x block_size=16): {n + 52} too "
                   f"many; lower max_tokens to at most {48 - n} or give the engine more blocks\n")


async def test_over_http_a_request_naming_no_length_gets_what_fits():
    """No max_tokens: the server's default (16 for completions) or what fits, whichever is less;
    never a refusal for a limit the client did not choose."""
    async with serving(CONFIG, backend=pool_bound()) as s:
        async with httpx.AsyncClient(base_url=s.url) as http:
            r = await http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True,
                                                         "return_token_ids": True})
            assert r.status_code == 200
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "pool"
            assert choice["token_ids"] == expected_continuation(PROMPT, 11)
            short = await http.post("/v1/completions", json={"prompt": PROMPT[:20],
                                                             "ignore_eos": True})
            assert short.json()["choices"][0]["finish_reason"] == "length"
            assert short.json()["usage"]["completion_tokens"] == 16
