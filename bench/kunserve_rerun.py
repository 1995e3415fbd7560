"""Re-run a KunServe round's simulator files from a snapshot of the code, before and after a
change, and compare them (issue 16, rounds 12-13; simulator, virtual time).

The commands are `bench/results/kunserve_round13_commands.json` (`plan` writes it):
- `files`: round 12's set (`kunserve_pool_round12.json`): each kunserve_sim* and
  kunserve_dispatch_* file's own command line, its KunServe rows only (`--only`/`--policies`),
  `--merge`d into a copy of the committed file, so the baselines, SLO and demand stay recorded;
- `modes`: round 12's restore settings on its eight windows, links as fitted and at half
  (`kunserve_restore.py --modes`);
- `rules`: the restore rules of rounds 8-9 (never, 50% and 40% for 4 s) on round 9's eight
  windows and its nine held-out ones, at the default monitor interval (50 ms).

    mkdir -p /tmp/r13/code && git archive <commit> | tar -x -C /tmp/r13/code
    ln -s /work/shared /tmp/r13/shared          # the traces, where bench/ looks for them
    python bench/kunserve_rerun.py run --code /tmp/r13/code --commit <commit> --label after \
        --scratch /tmp/r13/out --sets files,modes --jobs 2
    python bench/kunserve_rerun.py collect --scratch /tmp/r13/out --labels before,after \
        --out bench/results/kunserve_round13

`collect` puts the KunServe rows of every label (and round 12's recorded ones, where kept)
side by side in <out>.json and a table per file in <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
COMMANDS = RESULTS / "kunserve_round13_commands.json"
LADDER = ("kunserve_drop", "kunserve_exchange", "kunserve_lookahead", "kunserve")
RULES = "never (kunserve_lookahead),for 4s,40% for 4s"
MODES_WINDOWS = ("code_05x", "code_1320_05x", "conv_095x", "conv_2670_13x", "conv_long",
                 "longctx_01x", "longctx_2730_01x", "mooncake_3000_01x")
"""Round 12's restore windows (`kunserve_restore_round12_<w>.json`)."""
RULE_FILES = ("round9_conv_095x", "round9_conv_09x", "round9_longctx_01x", "round9_conv_long",
              "round9_conv_long2", "round9_conv_long3", "round9_code_05x", "round9_code_1x",
              "heldout_round9_conv_2670_12x", "heldout_round9_conv_2670_13x",
              "heldout_round9_conv_150_13x", "heldout_round9_code_1320_075x",
              "heldout_round9_longctx_2730_01x", "heldout_round9_mooncake_3000_01x",
              "heldout_round9_code_1320_05x", "heldout_round9_conv_2670_1x",
              "heldout_round9_conv_150_1x")
"""Rounds 9's windows (`kunserve_restore_<f>.json`), in round 9's run order."""
KEYS = ("trace", "start", "duration", "rate")


def workload_args(spec: str) -> list[str]:
    """A bench JSON's `workload` ("azure-conv:start=1560.0,duration=45.0,rate=0.1x,
    scale_lengths=5,...") as the trace arguments that make it again."""
    trace, _, rest = spec.partition(":")
    fields = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    missing = [k for k in KEYS[1:] if k not in fields]
    if missing:
        raise ValueError(f"workload {spec!r} has no {', '.join(missing)}")
    argv = ["--trace", trace] + [a for k in KEYS[1:] for a in (f"--{k}", fields.pop(k))]
    return argv + (["--lengths", ",".join(f"{k}={v}" for k, v in fields.items())]
                   if fields else [])


def plan() -> list[dict]:
    """Every command of the round: name, set, argv (from the repository root, `--out` last and
    replaced by `run`), and whether it merges into a copy of the committed file."""
    out = []
    for name, f in json.loads((RESULTS / "kunserve_pool_round12.json").read_text())[
            "files"].items():
        argv = shlex.split(f["command"])
        out.append({"name": name, "set": "files", "argv": argv[1:argv.index("--out")],
                    "merge": True})
    for w in MODES_WINDOWS:
        spec = json.loads((RESULTS / f"kunserve_restore_round12_{w}.json").read_text())[
            "workload"]
        base = ["bench/kunserve_restore.py", *workload_args(spec), "--modes"]
        out.append({"name": f"modes_{w}", "set": "modes", "argv": base, "merge": False})
        out.append({"name": f"modes_{w}_halflinks", "set": "modes", "merge": False,
                    "argv": base + ["--link-scale", "0.5", "--host-scale", "0.5"]})
    for f in RULE_FILES:
        spec = json.loads((RESULTS / f"kunserve_restore_{f}.json").read_text())["workload"]
        out.append({"name": _rule_name(f), "set": "rules", "merge": False,
                    "argv": ["bench/kunserve_restore.py", *workload_args(spec),
                             "--intervals", "50", "--only", RULES]})
    return out


def whole(argv: list[str]) -> list[str]:
    """A files command re-running every row of its file (baselines, SLO and demand too: what
    a change of the instances' own pools moves), not merged into the committed file."""
    out, skip = [], False
    for a in argv:
        if skip or a == "--merge":
            skip = False
            continue
        if a == "--only":  # (bench/kunserve_dispatch.py's --policies kunserve: both policies)
            skip = True
            continue
        if a == "--policies":
            out += ["--policies", "vllm_dp,kunserve"]
            skip = True
            continue
        out.append(a)
    return out


def _start(cmd: dict, code: Path, dest: Path, env: dict, *,
           whole_files: bool) -> subprocess.Popen:
    out = dest / cmd["name"]
    argv = cmd["argv"]
    if cmd["set"] == "files" and whole_files:
        argv = whole(argv)
    elif cmd["merge"]:  # the committed file's baselines, SLO and demand, KunServe rows re-run
        shutil.copyfile(RESULTS / f"{cmd['name']}.json", out.with_suffix(".json"))
    argv = [sys.executable, *argv, "--out", str(out)]
    log = out.with_suffix(".log").open("w")
    return subprocess.Popen(argv, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)


def run(args) -> None:
    code = Path(args.code).resolve()
    if not (code.parent / "shared" / "traces").is_dir():
        sys.exit(f"{code.parent / 'shared' / 'traces'} is missing: bench/ reads the traces from "
                 f"the code's parent folder (ln -s /work/shared {code.parent / 'shared'})")
    dest = Path(args.scratch).resolve() / args.label
    dest.mkdir(parents=True, exist_ok=True)
    sets, order = set(args.sets.split(",")), list(filter(None, args.only.split(",")))
    only = set(order)
    todo = [c for c in plan() if c["set"] in sets and (not only or c["name"] in only)]
    todo.sort(key=lambda c: order.index(c["name"]) if only else 0)  # --only's order
    unknown = only - {c["name"] for c in plan()}
    if unknown:
        sys.exit(f"--only: no command named {', '.join(sorted(unknown))}")
    env = os.environ | {"KUNSERVE_CODE": args.commit, "PYTHONHASHSEED": "0"}
    files = {c["name"] for c in todo if c["set"] == "files"}
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    with (dest / "runs.jsonl").open("a") as book:
        while todo or running:
            while todo and len(running) < args.jobs:
                cmd = todo.pop(0)
                running[cmd["name"]] = (_start(cmd, code, dest, env, whole_files=args.whole),
                                        time.time())
                print(f"{time.strftime('%H:%M:%S', time.gmtime())} start {cmd['name']}", flush=True)
            time.sleep(1.0)
            for name, (proc, began) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                row = {"name": name, "rc": proc.returncode, "commit": args.commit,
                       "whole": args.whole and name in files,
                       "began": time.strftime("%H:%M:%S", time.gmtime(began)),
                       "ended": time.strftime("%H:%M:%S", time.gmtime()),
                       "wall_s": round(time.time() - began, 1), "load": os.getloadavg()[0]}
                book.write(json.dumps(row) + "\n")
                book.flush()
                print(f"{row['ended']} end {name} rc {proc.returncode} ({row['wall_s']} s, "
                      f"load {row['load']:.1f})", flush=True)


def kunserve_rows(cmd: dict, report: dict, *, whole_file: bool = False) -> dict:
    """The rows a command re-ran: its KunServe runs (files merged into the committed file), or
    every run (files run whole, modes, rules)."""
    runs = report.get("runs", {})
    if cmd["set"] != "files" or whole_file:
        return runs
    argv = cmd["argv"]
    if "--only" in argv:
        keep = argv[argv.index("--only") + 1].split(",")
        return {k: v for k, v in runs.items() if k in keep}
    return {k: v for k, v in runs.items() if k.startswith("kunserve")}


RECORDED_REV: str | None = None
"""`collect --recorded-rev`: the commit whose bench/results files are "recorded" (a round that
replaced the files reads the ones before it)."""


def _results(name: str) -> dict:
    if RECORDED_REV is None:
        return json.loads((RESULTS / name).read_text())
    return json.loads(subprocess.run(
        ["git", "show", f"{RECORDED_REV}:bench/results/{name}"], cwd=ROOT, check=True,
        capture_output=True, text=True).stdout)


def recorded_rows(cmd: dict) -> dict | None:
    """Round 12's figures for the command, where a file kept them: its summary of the files
    set, its restore runs at fitted links; the rules as rounds 9 measured them at 50 ms."""
    r12 = json.loads((RESULTS / "kunserve_pool_round12.json").read_text())
    name = cmd["name"]
    if cmd["set"] == "files":  # the committed file's rows, its KunServe ones as round 12's
        committed = _results(f"{name}.json")["runs"]
        return committed | r12["files"].get(name, {}).get("after", {})
    if cmd["set"] == "modes" and not name.endswith("_halflinks"):
        return r12["restore_round12_fitted_links"].get(name.removeprefix("modes_"), {}).get(
            "after")
    if cmd["set"] == "rules":
        f = next(x for x in RULE_FILES if _rule_name(x) == name)
        runs = json.loads((RESULTS / f"kunserve_restore_{f}.json").read_text())["runs"]
        return {k.removesuffix(" @ 50 ms"): v for k, v in runs.items() if k.endswith("@ 50 ms")}
    return None


def _rule_name(f: str) -> str:
    return f"rules_{f.replace('round9_', '')}"


def _best_kv(cmd: dict, runs: dict) -> float | None:
    """The file's best KV-centric P99 TTFT (vllm_dp, infercept_swap), files set only."""
    kv = [runs[b]["ttft_p99_s"] for b in ("vllm_dp", "infercept_swap")
          if cmd["set"] == "files" and b in runs]
    return min(kv) if kv else None


def _norm(rows: dict | None) -> dict:
    """Rows by variant name without the shipped policy's mark (which rule carries it moved in
    round 9), without their series (`_slim`)."""
    return {k.removesuffix(" (kunserve)"): _slim(v) for k, v in (rows or {}).items()}


def _slim(row: dict) -> dict:
    """A row without its per-request and per-round series (the re-run files keep them)."""
    row = {k: v for k, v in row.items() if k not in ("ttft_series", "demand")}
    if "kv_usage" not in (row.get("cluster") or {}):
        return row
    return row | {"cluster": {k: v for k, v in row["cluster"].items() if k != "kv_usage"}}


def _events(row: dict) -> str:
    """Groups (g) and restores (r), seconds from the start."""
    if "cluster" in row:
        ev = [(e["t"], e["event"]) for e in row["cluster"].get("events", [])]
    else:
        ev = [(e[0], e[1]) for e in row.get("events", [])]
    return ", ".join(f"{t:.1f}{e[0]}" for t, e in ev)


def cells(row: dict, best_kv: float | None) -> list[str]:
    c = row.get("cluster") or {}
    out = [f"{row['ttft_p50_s']:.3f}", f"{row['ttft_p99_s']:.3f}", f"{row['tpot_p50_ms']:.1f}",
           f"{row['tpot_p99_ms']:.1f}"]
    out.append(f"{row['slo_violations']:.1%}" if "slo_violations" in row else "")
    out.append(f"{c['bubble_ratio']:.3f}" if c.get("bubble_ratio") is not None else "")
    stall = row.get("restore_stall_s", c.get("restore_stall_s"))
    out.append(f"{stall:.3f}" if stall is not None else "")
    out.append(f"{best_kv / row['ttft_p99_s']:.2f}x" if best_kv else "")
    return out + [_events(row)]


HEADER = ("| run | code | P50 TTFT s | P99 TTFT s | P50 TPOT ms | P99 TPOT ms | SLO viol. | "
          "bubble | restore stall s | P99 vs best KV-centric | groups (g), restores (r), s |")


def collect(args) -> None:
    scratch, labels = Path(args.scratch), args.labels.split(",")
    books = {lb: [json.loads(x) for x in (scratch / lb / "runs.jsonl").read_text().splitlines()]
             for lb in labels if (scratch / lb / "runs.jsonl").exists()}
    report = {"what": "KunServe simulator rows re-run by bench/kunserve_rerun.py: recorded = "
                      "round 12's figures where a file kept them (rules: round 9's at 50 ms); "
                      "each label a snapshot of a commit (`code`); seed 0; virtual time",
              "runs": books, "files": {}}
    lines = ["# " + report["what"], ""]
    moved = []
    for cmd in plan():
        got = {lb: scratch / lb / f"{cmd['name']}.json" for lb in labels}
        got = {lb: json.loads(p.read_text()) for lb, p in got.items()
               if p.exists() and any(b["name"] == cmd["name"] and b["rc"] == 0
                                     for b in books.get(lb, []))}
        if not got:
            continue
        whole_in = {lb for lb in got if any(b["name"] == cmd["name"] and b.get("whole")
                                            for b in books[lb])}
        rows = {"recorded": _norm(recorded_rows(cmd))} | {
            lb: _norm(kunserve_rows(cmd, rep, whole_file=lb in whole_in))
            for lb, rep in got.items()}
        any_rep = next(iter(got.values()))
        best_kv = {lb: _best_kv(cmd, r) for lb, r in rows.items()}
        for lb in got:  # a merged file's baselines are the committed ones
            best_kv[lb] = best_kv[lb] or _best_kv(cmd, got[lb].get("runs", {}))
        argv = whole(cmd["argv"]) if whole_in else cmd["argv"]
        report["files"][cmd["name"]] = {"workload": any_rep.get("workload"),
                                        "command": "python " + shlex.join(argv)} | rows
        lines += [f"### {cmd['name']}: {any_rep.get('workload')}", "",
                  f"`python {shlex.join(argv)} --out ...`"
                  + (f" (whole: {', '.join(sorted(whole_in))})" if whole_in else ""), "", HEADER,
                  "|" + "---|" * 11]
        names = list(dict.fromkeys(k for r in rows.values() for k in r))
        r12_rows = _norm(json.loads((RESULTS / "kunserve_pool_round12.json").read_text())[
            "files"].get(cmd["name"], {}).get("after"))
        for run_name in names:
            seen = []
            for lb, r in rows.items():
                if run_name not in r:
                    continue
                row = r[run_name]
                code = row.get("code") or (lb if lb != "recorded" else "round 12" if (
                    run_name in r12_rows or cmd["set"] == "modes") else "committed file")
                lines.append(f"| {run_name} | {lb}, {code} | "
                             + " | ".join(cells(row, best_kv[lb])) + " |")
                seen.append((lb, tuple(round(row[k], 6) for k in (
                    "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms"))))
            if len({v for _, v in seen}) > 1:
                moved.append(f"{cmd['name']} / {run_name}: " + "; ".join(
                    f"{lb} P99 TTFT {v[1]:.3f} s" for lb, v in seen))
        lines.append("")
    lines[2:2] = ["Rows whose P50/P99 TTFT or TPOT differ between the columns:", ""] + [
        f"- {m}" for m in moved] + [""]
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:len(moved) + 4]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("plan", help=f"write {COMMANDS.name}")
    r = sub.add_parser("run", help="run the commands from a snapshot of the code")
    r.add_argument("--code", required=True, help="the snapshot's root (git archive of a commit)")
    r.add_argument("--commit", required=True, help="what the rows' `code` says it is")
    r.add_argument("--label", required=True, help="before, after, ... (a folder of --scratch)")
    r.add_argument("--scratch", required=True)
    r.add_argument("--sets", default="files,modes", help="files, modes, rules (comma-separated)")
    r.add_argument("--only", default="", help="command names (comma-separated), run in this "
                   "order")
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--whole", action="store_true", help="files: every row re-run, not merged "
                   "into the committed file (a change of the instances' own pools moves the "
                   "baselines too)")
    c = sub.add_parser("collect", help="the labels' rows side by side")
    c.add_argument("--scratch", required=True)
    c.add_argument("--labels", default="before,after")
    c.add_argument("--out", required=True)
    c.add_argument("--recorded-rev", default=None, help="read the recorded files at this commit")
    args = ap.parse_args()
    if args.what == "plan":
        COMMANDS.write_text(json.dumps(plan(), indent=1) + "\n")
        print(f"{COMMANDS}: {len(plan())} commands")
    elif args.what == "run":
        run(args)
    else:
        global RECORDED_REV
        RECORDED_REV = args.recorded_rev
        collect(args)


if __name__ == "__main__":
    main()
