"""`shunter bench --backend http`: the same driver, arrivals and metrics as an in-process run,
sent through `shunter.Client` to a running OpenAI-compatible server (Shunter's or another, such
as vLLM), in real time, with timelines taken on the client's clock.

Against a Shunter server (one whose admin API answers `GET /admin/policy`) each `--policy` is
sent to the server through `PUT /admin/policy` before its run, and Shunter's scheduling fields
(class, SLOs, priority, tenant, conversation) go with every request. Any other server gets only
OpenAI's fields and vLLM's sampling extras, and serves whatever it was started with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import anyio
import attrs

from engine.errors import PolicyError, ShunterError
from engine.metrics import run_metrics
from policy_lang.api import compile_policy, load_policy_file
from shunter.benchmark.driver import Driver, expected_requests
from shunter.benchmark.policies import PolicyChoice
from shunter.benchmark.progress import Progress
from shunter.benchmark.run import RunOutcome, runs_json
from shunter.remote import Client
from shunter.workloads import Workload

SERVER_POLICY = "(server's policy)"
"""How a run without `--policy` is named: the server keeps the policy it runs."""


@attrs.frozen(kw_only=True)
class HttpTarget:
    """The server a benchmark is sent to."""

    url: str
    api_key: str | None = None
    model: str | None = None
    """The served model's name (default: the first one `/v1/models` lists)."""
    vocab: int = 32_000
    """Token ids of the workload's prompts are drawn below this (32,000 fits Llama-2, Mistral,
    Llama-3 and Qwen2 alike; give the model's own vocabulary size for a smaller model)."""


async def _running_policy(client: Client) -> dict[str, Any] | None:
    """The server's policy (name, version, source) when it is a Shunter server, else None."""
    try:
        answer = await client.get_policy()
    except ShunterError:
        return None
    return answer if isinstance(answer, dict) and "source" in answer else None


def _declared_classes(running: dict[str, Any]) -> set[str]:
    if isinstance(running.get("classes"), list):
        return {str(c) for c in running["classes"]}
    try:
        policy = compile_policy(str(running["source"]), filename=str(running.get("name", "<server>")))
    except PolicyError:  # e.g. an include the server resolves and we cannot: send no class
        return set()
    return {c.name for c in policy.settings.classes}


async def _is_shunter(client: Client) -> bool:
    cards = (await client.request_json("GET", "/v1/models") or {}).get("data") or []
    return any(isinstance(c, dict) and c.get("owned_by") == "shunter" for c in cards)


async def _prepare(client: Client, choice: PolicyChoice | None) -> set[str]:
    """Make the server run `choice` (when given) and return the request classes it declares.
    Raises PolicyError when that cannot be done."""
    running = await _running_policy(client)
    client.extensions = running is not None or await _is_shunter(client)
    if choice is None:
        return _declared_classes(running) if running is not None else set()
    if running is None:
        raise PolicyError(f"--policy {choice.label!r}: the server at {client.base_url} has no "
                          f"Shunter admin API (GET /admin/policy), so its policy cannot be replaced")
    if choice.overrides:
        raise PolicyError(f"--policy {choice.label!r}: engine settings "
                          f"({', '.join(choice.overrides)}) cannot change on a running server")
    policy = load_policy_file(choice.path)  # checked here first: its errors name the local file
    await client.replace_policy(choice.path.read_text(), filename=str(choice.path))
    return {c.name for c in policy.settings.classes}


async def _drive(target: HttpTarget, choice: PolicyChoice | None, workload: Workload,
                 progress: bool) -> tuple[Any, dict[str, Any]]:
    async with Client(target.url, target.api_key, model=target.model) as client:
        declared = await _prepare(client, choice)
        server = {"url": target.url, "model": await client.served_model(),
                  "policy_file": str(choice.path) if choice else None,
                  "shunter_extensions": client.extensions}
        label = choice.label if choice else SERVER_POLICY
        bar = Progress(label, expected_requests(workload),
                       clock=anyio.current_time) if progress else None
        driver = Driver(client, workload, vocab=target.vocab, declared_classes=declared,
                        on_progress=bar.update if bar else None)
        result = await driver.run()
        if bar:
            bar.close()
    return result, server


def run_http_one(choice: PolicyChoice | None, workload: Workload, target: HttpTarget, *,
                 async_backend: str = "asyncio", progress: bool = True) -> RunOutcome:
    label = choice.label if choice else SERVER_POLICY
    server = {"url": target.url, "model": target.model,
              "policy_file": str(choice.path) if choice else None}
    began = time.perf_counter()
    try:
        drive, server = anyio.run(_drive, target, choice, workload, progress, backend=async_backend)
    except ShunterError as exc:
        return RunOutcome(label=label, config=None, server=server,
                          wall_s=time.perf_counter() - began, error=f"{type(exc).__name__}: {exc}")
    metrics = run_metrics(drive.timelines, duration_s=drive.finished - drive.started,
                          goals=drive.goals, failed=drive.failed)
    return RunOutcome(label=label, config=None, server=server, wall_s=time.perf_counter() - began,
                      metrics=metrics, drive=drive)


def run_http_all(choices: Sequence[PolicyChoice], workload: Workload, target: HttpTarget, *,
                 async_backend: str = "asyncio", progress: bool = True) -> list[RunOutcome]:
    """One run per policy (each sent to the server first), or one run of the server's own
    policy when no policy is given."""
    return [run_http_one(c, workload, target, async_backend=async_backend, progress=progress)
            for c in (choices or [None])]


def http_report_json(workload: Workload, target: HttpTarget,
                     outcomes: Sequence[RunOutcome]) -> dict[str, Any]:
    """The bench JSON of an in-process run, with the server in place of the engine settings.
    Swap counters, scheduler time and the KV time series are the server's own and are not
    seen from outside: they stay zero or absent."""
    served = next((o.server["model"] for o in outcomes if o.server and o.server.get("model")),
                  target.model)
    return {"workload": workload.describe(), "backend": "http", "runs": runs_json(outcomes),
            "url": target.url, "model": served}
