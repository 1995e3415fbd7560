"""Property-based fuzzing of the HTTP API: hypothesis builds bodies from the fields the OpenAPI
schema names (with values of any JSON type, out-of-range numbers, junk bytes); no answer may be
a 5xx, none may hang, and the engine serves normally afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shunter import EngineConfig
from shunter.server.openapi import SCHEMA
from tests.fakes import fake_backend
from tests.shunter.server.conftest import ServerThread

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FIELDS = sorted({name for path in ROUTES
                 for name in SCHEMA["paths"][path]["post"]["requestBody"]["content"]
                 ["application/json"]["schema"]["properties"]})

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
field_values = st.one_of(
    json_values, st.integers(-5, 70), st.lists(st.integers(-2, 40), min_size=1, max_size=6),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 3]),
                                    "content": json_values}), max_size=3))
bodies = st.dictionaries(st.sampled_from(FIELDS + ["junk"]), field_values, max_size=8)
raw_bodies = st.binary(max_size=200)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def fuzz_server(request):
    config = EngineConfig(block_size=4, max_num_seqs=16)
    server = ServerThread(config, None, request.param,
                          engine_backend=fake_backend(64, 4, max_context=64)).start()
    yield server
    server.stop()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=bodies, raw=st.none() | raw_bodies)
def test_no_body_gets_a_5xx_or_hangs(fuzz_server, route, body, raw):
    content = raw if raw is not None else json.dumps(body).encode()
    r = httpx.post(fuzz_server.url + route, content=content, timeout=20,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_engine_serves_after_the_fuzzing(fuzz_server):
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=20,
                   json={"prompt": [3, 4], "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    snap = httpx.get(fuzz_server.url + "/test/inspect?idle=1", timeout=30).json()
    assert snap["allocated"] == 0
