"""Admin routes: the running policy read, replaced (a broken one refused with every error, the
running one kept), versions counted, rolled back; refused to other hosts and wrong keys."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from starlette.applications import Starlette

from policies import policy_path
from shunter import Engine, EngineConfig, SamplingParams, SchedulingParams
from shunter.server.admin import Admin
from tests.fakes import fake_backend

pytestmark = pytest.mark.anyio

CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_batched_tokens=64)
BROKEN = ('policy broken extends "fcfs.policy" {\n'
          "  priority = arival asc\n"
          "  batch max 0\n"
          "}\n")
RTBE = 'policy two extends "round_robin_rtbe.policy" {\n}\n'


@contextlib.asynccontextmanager
async def admin_client(api_key: str | None = None, host: str = "127.0.0.1"):
    async with Engine.start(CONFIG, backend=fake_backend(64, 4)) as engine:
        admin = Admin(engine, api_key=api_key)
        app = Starlette(routes=admin.routes())
        transport = httpx.ASGITransport(app=app, client=(host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, admin


async def test_replace_refuse_and_roll_back_with_versions():
    async with admin_client() as (client, admin):
        got = (await client.get("/admin/policy")).json()
        assert (got["name"], got["version"], got["last_diff"]) == ("fcfs", 1, None)
        assert got["source"] == policy_path("fcfs").read_text()
        assert got["filename"] == str(policy_path("fcfs"))

        broken = await client.put("/admin/policy?filename=mine.policy", content=BROKEN)
        assert broken.status_code == 400
        body = broken.json()
        assert body["error"]["code"] == "policy_error"
        assert body["errors"] == [
            "mine.policy:2:14: unknown field 'arival'; did you mean 'arrival'?",
            "mine.policy:3:13: batch max must be a whole number >= 1, got 0",
        ]
        assert body["error"]["message"] == "\n".join(body["errors"])
        assert admin.engine.policy.settings.name == "fcfs" and admin.engine.policy_version == 1

        replaced = await client.put("/admin/policy", content=RTBE)
        assert replaced.status_code == 200
        change = replaced.json()
        assert (change["name"], change["version"], change["previous"]) == ("two", 2, "fcfs")
        assert change["diff"].startswith("--- fcfs (running)\n+++ two (new)\n")
        assert (await admin.engine.inspect()).scheduler.policy_version == 2
        got = (await client.get("/admin/policy")).json()
        assert (got["name"], got["version"], got["classes"]) == ("two", 2, ["rt", "be"])
        assert got["last_diff"] == change["diff"]

        back = await client.post("/admin/policy/rollback")
        assert back.status_code == 200
        assert (back.json()["name"], back.json()["version"]) == ("fcfs", 3)
        again = await client.post("/admin/policy/rollback")
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "no_previous_policy"
        assert admin.engine.policy_version == 3

        bad_utf8 = await client.put("/admin/policy", content=b"policy \xff {}")
        assert bad_utf8.status_code == 400 and bad_utf8.json()["error"]["code"] == "invalid_request"


async def test_stats_show_queues_and_per_class_attainment():
    async with admin_client() as (client, admin):
        await client.put("/admin/policy", content=RTBE)
        for cls in ("rt", "rt", "be"):
            scheduling = SchedulingParams(request_class=cls)
            async for last in admin.engine.generate([1, 2, 3], SamplingParams(
                    max_tokens=3, ignore_eos=True), scheduling=scheduling):
                pass
            admin.finished.on_finished(last, last.finish_reason, scheduling)
        stats = (await client.get("/admin/stats")).json()
        sched = stats["scheduler"]
        assert (sched["policy"], sched["policy_version"]) == ("two", 2)
        assert (sched["waiting"], sched["running"], sched["preemptions"]) == (0, 0, 0)
        assert sched["overload"] is None
        rows = {c["label"]: c for c in stats["classes"]}
        assert (rows["rt"]["done"], rows["be"]["done"]) == (2, 1)
        assert rows["rt"]["ttft_met"] == 1.0 and rows["be"]["ttft_met"] is None
        assert rows["rt"]["ttft_ms"]["count"] == 2
        await client.post("/admin/policy/rollback")  # counts start afresh per policy
        stats = (await client.get("/admin/stats")).json()
        assert [c["done"] for c in stats["classes"]] == [0]


async def test_other_hosts_are_refused_without_a_key():
    async with admin_client(host="203.0.113.7") as (client, admin):
        for method, path in (("GET", "/admin/policy"), ("PUT", "/admin/policy"),
                             ("POST", "/admin/policy/rollback"), ("GET", "/admin/stats")):
            r = await client.request(method, path, content=RTBE)
            assert r.status_code == 403, path
            assert r.json()["error"]["code"] == "forbidden"
        assert admin.engine.policy_version == 1


async def test_with_a_key_set_only_the_key_opens_them():
    async with admin_client(api_key="sesame", host="203.0.113.7") as (client, admin):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = await client.get("/admin/policy", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        ok = await client.put("/admin/policy", content=RTBE,
                              headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and admin.engine.policy_version == 2
