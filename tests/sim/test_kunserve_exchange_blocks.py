"""A simulated KunServe group's formation exchange moves what the torch members move: each
waiting request's KV in whole blocks (gpu/group_messages.py `start_transfers`: ceil(computed
tokens / block size) blocks), of the layers the other members keep, from the member holding it
(shunter/cluster/sim_formation.py). Before s32 the simulator charged the tokens alone, so a
request's partly filled last block moved only in part.

The bytes are computed here from the requests' lengths and the model's shape: a block of one
Llama-3-8B layer holds K and V of 16 tokens, 8 KV heads of 128 values in 2 bytes: 64 KiB."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import trio
import trio.testing

import shunter
from engine.cluster.drop_plan import GroupPlan
from engine.config import EngineConfig
from policies import policy_path
from shunter.cluster.cluster import Cluster
from shunter.cluster.sim_formation import exchange
from sim.network import LINKS
from sim.profile import load_profile

LAYER_BLOCK = 2 * 16 * 8 * 128 * 2  # K and V, 16 tokens, 8 KV heads x 128, bf16


def _groups(started: list):
    """What `exchange` reads of shunter/cluster/groups.py's SimGroups; the exchanges it starts
    are recorded, not run."""
    net = SimpleNamespace(exchanges=None)
    head = SimpleNamespace(engine=SimpleNamespace(backend=SimpleNamespace(
        runner=SimpleNamespace(network=net))))
    tg = SimpleNamespace(start_soon=lambda fn, queue, arrived: started.append(list(queue)))
    return SimpleNamespace(model=load_profile("llama3-8b-a10").model, block_size=16,
                           instances=[head, head, head], faults={}, exchanging={},
                           link=LINKS["a100-internode"], coordinated=True, _tg=tg,
                           counters=SimpleNamespace(kv_exchanged_bytes=0))


def _req(rid: int, tokens: int):
    return SimpleNamespace(id=rid, computed_tokens=tokens)


def test_the_formation_moves_whole_blocks_of_the_layers_others_keep():
    started: list = []
    groups = _groups(started)
    two = GroupPlan(group_id=0, members=(0, 1), layers=(range(0, 16), range(16, 32)))
    # the head's own (1, 2) and member 1's (3, 4, adopted): 17 tokens fill 2 blocks, 32 two,
    # 1 one, 399 twenty-five; each source sends the 16 layers it drops
    waiting = [_req(1, 17), _req(2, 32), _req(3, 1), _req(4, 399)]
    exchange(groups, two, waiting, {3: 1, 4: 1})
    layer_blocks = {1: 2 * 16, 2: 2 * 16, 3: 1 * 16, 4: 25 * 16}
    assert started == [[(1, layer_blocks[1] * LAYER_BLOCK), (2, layer_blocks[2] * LAYER_BLOCK)],
                       [(3, layer_blocks[3] * LAYER_BLOCK), (4, layer_blocks[4] * LAYER_BLOCK)]]
    assert groups.counters.kv_exchanged_bytes == sum(layer_blocks.values()) * LAYER_BLOCK
    assert groups.exchanging[0].pending == {1, 2, 3, 4}
    assert len(groups.instances[0].engine.backend.runner.network.exchanges) == 2


def test_an_uneven_group_sends_each_sources_dropped_layers():
    started: list = []
    groups = _groups(started)
    three = GroupPlan(group_id=0, members=(2, 0, 1),
                      layers=(range(0, 11), range(11, 22), range(22, 32)))
    exchange(groups, three, [_req(7, 33), _req(8, 16)], {8: 1})
    # head 2 keeps 11 layers and sends 21 of request 7's 3 blocks; member 1 keeps 10, sends 22
    assert started == [[(7, 3 * 21 * LAYER_BLOCK)], [(8, 1 * 22 * LAYER_BLOCK)]]
    assert groups.exchanging[2].pending == {7, 8}


async def _burst():
    config = EngineConfig(backend="sim", cpu_swap_blocks=0, num_blocks=300,
                          policy=policy_path("kunserve_exchange"))
    async with Cluster.start(config, instances=2, kind="inprocess") as cluster:
        async def one(i: int) -> None:
            await anyio.sleep(i * 0.005)
            await cluster.complete(list(range(1, 391 + i % 7)), shunter.SamplingParams(
                max_tokens=40, ignore_eos=True))

        with anyio.fail_after(120):  # virtual seconds
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(one, i)
        return cluster.groups


def test_a_burst_exchanges_whole_blocks():
    groups = trio.run(_burst, clock=trio.testing.MockClock(autojump_threshold=0))
    (event,) = [e for e in groups.counters.events if e["event"] == "group"]
    assert event["exchanging"] > 0
    # two halves: each request's blocks of 16 layers, 1 MiB a block
    exchanged = groups.counters.kv_exchanged_bytes
    assert exchanged > 0 and exchanged % (16 * LAYER_BLOCK) == 0, exchanged / (16 * LAYER_BLOCK)
    assert groups.exchanging[event["members"][0]].pending == set()
