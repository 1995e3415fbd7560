"""Workload specs, trace readers (on small hand-written traces), generators and lazy token ids."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from shunter.workloads import TraceError, WorkloadSpecError, load_workload, parse_spec
from shunter.workloads.synthetic import arrivals, multiturn
from shunter.workloads.tokens import RandomRun, TokenIds, extend_context
from shunter.workloads.traces import DEFAULT_TRACES_DIR, FILES, link_prefixes
from shunter.workloads.workload import BatchSource, RequestSpec, rescale, window


def write_gz(path: Path, text: str) -> None:
    with gzip.open(path, "wt") as f:
        f.write(text)


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    write_gz(tmp_path / FILES["azure-conv"],
             "TIMESTAMP,ContextTokens,GeneratedTokens\n"
             "2023-11-16 18:15:46.6805900,374,44\n"
             "2023-11-16 18:15:50.9951690,396,109\n"
             "2023-11-16 18:15:56.6805900,1000,10\n"
             "2023-11-16 18:16:06.6805900,20,5\n")
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 50, "hash_ids": [1, 2, 3]},
        # shares the whole parent's two full blocks and more: a later turn of the first
        {"timestamp": 3000, "input_length": 1700, "output_length": 20, "hash_ids": [1, 2, 4, 5]},
        # shares only block 1 (a system prompt): a shared prefix, not a turn
        {"timestamp": 3000, "input_length": 700, "output_length": 20, "hash_ids": [1, 9]},
        {"timestamp": 6000, "input_length": 300, "output_length": 30, "hash_ids": [7]},
    ]
    write_gz(tmp_path / FILES["mooncake-conv"], "".join(json.dumps(r) + "\n" for r in rows))
    write_gz(tmp_path / FILES["sharegpt"],
             "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
             "100,10,110,10\n200,20,220,10\n300,30,330,10\n")
    return tmp_path


# ------------------------------------------------------------------------ specs


def test_spec_strings_parse_names_and_keys():
    assert parse_spec("azure-conv") == ("azure-conv", {})
    assert parse_spec("sharegpt: rate=2x, seed=3") == ("sharegpt", {"rate": "2x", "seed": "3"})


@pytest.mark.parametrize("spec, message", [
    ("azure", "unknown workload 'azure'; known: azure-conv, azure-code"),
    ("azure-conv:speed=2", "azure-conv:speed=2: unknown key 'speed'; known: rate, start"),
    ("azure-conv:rate", "'rate' is not key=value"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(WorkloadSpecError, match=message.replace("(", r"\(")):
        parse_spec(spec)


def test_bad_values_name_the_key(traces):
    with pytest.raises(WorkloadSpecError, match=r"azure-conv:rate=fast: rate='fast' is neither"):
        load_workload("azure-conv:rate=fast", traces_dir=traces)
    with pytest.raises(WorkloadSpecError, match=r"requests='many' is not a valid int"):
        load_workload("azure-conv:requests=many", traces_dir=traces)


def test_a_toml_file_says_the_same(traces, tmp_path):
    f = tmp_path / "w.toml"
    f.write_text('name = "azure-conv"\nrate = "2x"\nrequests = 3\n')
    w = load_workload(str(f), traces_dir=traces)
    assert len(w.requests) == 3 and w.params["rate"] == "2x"


def test_a_missing_trace_file_says_where_to_put_it(tmp_path):
    with pytest.raises(TraceError, match=r"workload azure-code needs .*azure2023_AzureLLMInferenceTrace_code"
                                         r".csv.gz, which does not exist; pass the folder"):
        load_workload("azure-code", traces_dir=tmp_path)


# ------------------------------------------------------------------------ traces


def test_azure_window_rate_and_lengths(traces):
    w = load_workload("azure-conv", traces_dir=traces)
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.0, 4.314579, 10.0, 20.0])
    assert [(r.prompt_tokens, r.output_tokens) for r in w.requests][:2] == [(374, 44), (396, 109)]
    w = load_workload("azure-conv:start=4,duration=10,rate=2x,scale_lengths=0.5", traces_dir=traces)
    # the window [4, 14) holds the 2nd and 3rd request, shifted to start at 0, then 2x faster
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.1572895, 3.0])
    assert [(r.prompt_tokens, r.output_tokens) for r in w.requests] == [(198, 54), (500, 5)]
    assert w.duration_s == pytest.approx(5.0)
    w = load_workload("azure-conv:rate=0.4", traces_dir=traces)   # 4 requests in 20 s -> 0.2/s
    assert w.requests[-1].arrival_s == pytest.approx(10.0)


def test_mooncake_prefixes_become_turns_and_shared_prompts(traces):
    w = load_workload("mooncake-conv", traces_dir=traces)
    first, turn, sibling, alone = w.requests
    assert turn.parent == 0 and turn.after_parent_s == 0.0
    assert turn.conversation_id == first.conversation_id
    assert turn.shared_tokens == 1024           # two shared 512-token blocks
    # the latest request with block 1 is the turn
    assert sibling.parent == 1 and sibling.after_parent_s is None and sibling.shared_tokens == 512
    assert sibling.conversation_id != first.conversation_id
    assert alone.parent is None and alone.shared_tokens == 0
    assert w.describe()["later_turns"] == 1


def test_link_prefixes_takes_the_latest_longest_match():
    rows = [(0.0, 1100, 10, [1, 2, 3]), (1.0, 1100, 10, [1, 2, 3]), (2.0, 1600, 10, [1, 2, 3, 4])]
    specs = link_prefixes(rows, 512)
    assert specs[1].parent == 0 and specs[2].parent == 1
    assert specs[2].shared_tokens == 1110      # parent's prompt + output (3 blocks cover it)


@pytest.mark.skipif(not (DEFAULT_TRACES_DIR / FILES["azure-conv"]).is_file(),
                    reason="the shared traces are not here")
def test_the_real_azure_conversation_trace():
    w = load_workload("azure-conv")
    assert len(w.requests) == 19366
    assert 3400 < w.duration_s < 3700
    assert w.describe()["mean_prompt_tokens"] == pytest.approx(1155, abs=1)


# ------------------------------------------------------------------------ synthetic


def test_synthetic_workloads_are_seeded(traces):
    a = load_workload("sharegpt:requests=20,rate=4", traces_dir=traces, seed=1)
    b = load_workload("sharegpt:requests=20,rate=4", traces_dir=traces, seed=1)
    c = load_workload("sharegpt:requests=20,rate=4", traces_dir=traces, seed=2)
    assert a.requests == b.requests and a.requests != c.requests
    assert len(a.requests) == 20
    assert {(r.prompt_tokens, r.output_tokens) for r in a.requests} <= {(100, 10), (200, 20), (300, 30)}


def test_gamma_arrivals_are_burstier_than_poisson():
    import random
    import statistics

    def cv(process: str) -> float:
        t = arrivals(random.Random(0), rate=10, n=4000, process=process, cv=3.0)
        gaps = [b - a for a, b in zip([0.0] + t, t)]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert cv("poisson") == pytest.approx(1.0, abs=0.1)
    assert cv("gamma") == pytest.approx(3.0, abs=0.4)


def test_multiturn_turns_extend_the_conversation():
    import random

    table = [(100, 10), (50, 5)]
    specs = multiturn(random.Random(0), table, [0.0, 1.0], mean_turns=4, mean_think_s=2.0)
    by_conv: dict[str, list[RequestSpec]] = {}
    for s in specs:
        by_conv.setdefault(s.conversation_id, []).append(s)
    assert any(len(v) > 1 for v in by_conv.values())
    for turns in by_conv.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.parent == prev.index and nxt.after_parent_s > 0
            assert nxt.shared_tokens == prev.prompt_tokens + prev.output_tokens
            assert nxt.prompt_tokens - nxt.shared_tokens in (100, 50)


def test_multiturn_says_it_is_synthetic(traces):
    w = load_workload("multiturn:conversations=3", traces_dir=traces)
    assert "SYNTHETIC" in w.describe()["description"]


def test_be_batches_are_uniform_and_reproducible():
    src = BatchSource(batch_size=50, seed=3)
    batch = src.batch(2)
    assert batch == src.batch(2) and batch != src.batch(3)
    assert all(512 <= r.prompt_tokens <= 1024 and 32 <= r.output_tokens <= 128 for r in batch)
    assert all(r.request_class == "be" for r in batch)
    assert len({r.index for r in batch + src.batch(3)}) == 100


def test_rtbe_mixes_rt_requests_with_batches(traces):
    w = load_workload("rtbe:duration=30,batch_size=4", traces_dir=traces)
    assert w.batches[0].stop_s == 30 and w.batches[0].batch_size == 4
    assert all(r.request_class == "rt" and r.ttft_ms == 400 and r.tpot_ms == 200 for r in w.requests)


def test_tenants_and_markov_priorities_follow_conversations(traces):
    w = load_workload("multiturn:conversations=20,tenants=3,priority=markov,levels=4",
                      traces_dir=traces)
    tenant = {}
    for r in w.requests:
        assert tenant.setdefault(r.conversation_id, r.tenant) == r.tenant
        assert 0 <= r.priority < 4
    assert len(set(tenant.values())) > 1


def test_windows_drop_links_to_parents_outside():
    specs = [RequestSpec(index=0, arrival_s=0.0, prompt_tokens=10, output_tokens=1),
             RequestSpec(index=1, arrival_s=5.0, prompt_tokens=20, output_tokens=1, parent=0,
                         shared_tokens=11, after_parent_s=0.0)]
    kept = window(specs, start=1.0, duration=None, cap=None)
    assert kept[0].index == 0 and kept[0].parent is None and kept[0].shared_tokens == 0
    assert kept[0].arrival_s == 4.0
    scaled = rescale(specs, time=2.0, lengths=0.5, max_input=8)
    assert [(s.arrival_s, s.prompt_tokens, s.shared_tokens) for s in scaled] == [(0.0, 5, 0), (2.5, 8, 6)]


# ------------------------------------------------------------------------ token ids


def test_token_ids_are_lazy_reproducible_and_in_range():
    ids = TokenIds.random(seed=5, length=10**9, vocab=100, low=3)  # a billion ids, no memory
    assert len(ids) == 10**9
    assert ids[123_456_789] == TokenIds.random(5, 10**9, 100, 3)[123_456_789]
    assert all(3 <= t < 100 for t in ids[:1000])
    assert ids[-1] == ids[10**9 - 1]
    with pytest.raises(IndexError):
        ids[10**9]
    assert len(set(ids[:1000])) > 50


def test_extending_a_context_shares_its_prefix():
    parent = TokenIds([RandomRun(1, 30, 50), (7, 7, 7)])
    child = extend_context(parent, shared=32, total=40, seed=9, vocab=50)
    assert len(child) == 40
    assert child[:32] == list(parent)[:32]
    assert child[30:32] == [7, 7]
    assert list(child) == child[:]
    assert extend_context([1, 2, 3], shared=10, total=5, seed=0, vocab=50)[:3] == [1, 2, 3]


def test_prompts_of_a_workload_follow_their_parents(traces):
    w = load_workload("mooncake-conv", traces_dir=traces)
    first, turn = w.requests[0], w.requests[1]
    p0 = w.prompt(first, 320, None)
    context = TokenIds([p0, (1,) * first.output_tokens])
    p1 = w.prompt(turn, 320, context)
    assert len(p1) == turn.prompt_tokens and p1[:1024] == context[:1024]
    assert w.prompt(first, 320, None)[:50] == p0[:50]
