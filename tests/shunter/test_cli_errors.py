"""Every user mistake on the command line ends in one line naming the option and the value, and
exit code 2; never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies import available, policy_path
from shunter.cli import main

SHIPPED = ", ".join(available())
NO_CUDA = (f"this machine has no CUDA device (torch {torch.__version__} was built without CUDA)"
           if torch.version.cuda is None else
           f"this machine has no CUDA device (torch {torch.__version__} found no device for CUDA "
           f"{torch.version.cuda})")

BAD = [
    (["generate", "--prompt", "x", "--device", "tpu"],
     "shunter generate: --device tpu: not a device Shunter runs on (cpu, cuda, cuda:N or auto)"),
    (["demo", "--device", "tpu"],
     "shunter demo: --device tpu: not a device Shunter runs on (cpu, cuda, cuda:N or auto)"),
    (["generate", "--prompt", "x", "--num-blocks", "-1"],
     "shunter generate: argument --num-blocks: -1 is not a positive integer "
     "(see shunter generate --help)"),
    (["generate", "--prompt", "x", "--cpu-swap-blocks", "-2"],
     "shunter generate: argument --cpu-swap-blocks: -2 is negative (see shunter generate --help)"),
    (["generate", "--prompt", "x", "--threads", "two"],
     "shunter generate: argument --threads: 'two' is not an integer (see shunter generate --help)"),
    (["generate", "--prompt", "x", "--silent-after", "0.3"],
     "shunter generate: argument --silent-after: 0.3 must be more than 0.5 s (twice the ping "
     "interval), or 0 for never (see shunter generate --help)"),
    (["serve", "--silent-after", "soon"],
     "shunter serve: argument --silent-after: 'soon' is not a number of seconds "
     "(see shunter serve --help)"),
    (["generate", "--prompt", "x", "--dtype", "int8"],
     "shunter generate: argument --dtype: invalid choice: 'int8' (choose from 'auto', "
     "'float32', 'bfloat16', 'float16') (see shunter generate --help)"),
    (["generate", "--prompt", "x", "--model", "/nonexistent/model"],
     "shunter generate: --model /nonexistent/model: no such directory"),
    (["generate", "--prompt", ""], 'shunter generate: --prompt "": the prompt is empty'),
    (["generate", "--prompts-file", "/nonexistent/p.jsonl"],
     "shunter generate: --prompts-file /nonexistent/p.jsonl: cannot read it: "
     "No such file or directory"),
    (["generate", "--prompt", "x", "--policy", "fcsf"],
     f"shunter generate: --policy fcsf: no such policy file or shipped policy; did you mean "
     f"fcfs? shipped: {SHIPPED}"),
    (["policy", "explain", "brso"],
     f"shunter policy: brso: no such policy file or shipped policy; did you mean bros? "
     f"shipped: {SHIPPED}"),
    (["make-model", "--arch", "llama", "--out", "/nonexistent/m", "--hidden", "64",
      "--heads", "5"], "shunter make-model: --hidden 64 is not divisible by --heads 5"),
    (["make-model", "--arch", "llama", "--out", "/nonexistent/m", "--kv-heads", "3"],
     "shunter make-model: --heads 4 is not divisible by --kv-heads 3"),
    (["make-model", "--arch", "llama", "--out", "/nonexistent/m", "--layers", "0"],
     "shunter make-model: argument --layers: 0 is not a positive integer "
     "(see shunter make-model --help)"),
    (["bench", "--workload", "rtbe", "--policy", "fcfs", "--policy", "nope.policy"],
     f"shunter bench: --policy nope.policy: no such policy file or shipped policy; "
     f"shipped: {SHIPPED}"),
]
if not torch.cuda.is_available():
    BAD.append((["generate", "--prompt", "x", "--device", "cuda"],
                f"shunter generate: --device cuda: {NO_CUDA}"))


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_argument_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert out.err == message + "\n"


def test_a_fresh_process_prints_no_traceback():
    done = subprocess.run([sys.executable, "-m", "shunter.cli", "generate", "--prompt", "x",
                           "--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == ("shunter generate: --device tpu: not a device Shunter runs on "
                           "(cpu, cuda, cuda:N or auto)\n")


def test_a_swapping_policy_on_an_engine_without_swap_space_says_what_to_change(capsys):
    assert main(["generate", "--prompt", "x", "--policy", "fastswitch_markov",
                 "--cpu-swap-blocks", "0"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first == (f"shunter generate: {policy_path('vllm_baseline_markov')}:9:3: preempt swap "
                     "is not supported by this engine (it supports: never, recompute; this "
                     "engine has no swap space: --cpu-swap-blocks is 0)")


def test_policy_names_are_accepted_by_check_and_explain(capsys):
    assert main(["policy", "check", "bros", "fcfs"]) == 0
    assert capsys.readouterr().out == "bros: ok\nfcfs: ok\n"
    assert main(["policy", "explain", "bros"]) == 0
    assert capsys.readouterr().out.startswith(f"Policy bros ({policy_path('bros')}).")
    assert main(["policy", "check", "fcsf"]) == 2
    assert capsys.readouterr().out == (
        f"fcsf: no such policy file or shipped policy; did you mean fcfs? shipped: {SHIPPED}\n")


def test_make_model_refuses_a_non_empty_directory_without_force(tmp_path: Path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    argv = ["make-model", "--arch", "llama", "--out", str(tmp_path), "--layers", "1",
            "--hidden", "32", "--vocab", "300"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"shunter make-model: --out {tmp_path}: the directory is "
                                       "not empty (--force writes into it)\n")
    assert main([*argv, "--force"]) == 0
    assert (tmp_path / "config.json").is_file() and (tmp_path / "notes.txt").is_file()


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "a", "prompt_ids": [1]}', 'p.jsonl:2: has both "prompt" and "prompt_ids"; give one'),
    ('{"prompt_ids": []}', 'p.jsonl:2: "prompt_ids" is empty'),
    ('{"prompt": ""}', 'p.jsonl:2: "prompt" is empty'),
    ('{"prompt": "a", "max_tokens": "ten"}', 'p.jsonl:2: "max_tokens" must be an integer, got "ten"'),
    ('{"prompt": "a", "tenat": "x"}', 'p.jsonl:2: unknown key "tenat"; did you mean "tenant"? '
     '(keys: prompt, prompt_ids, max_tokens, temperature, priority, request_class, tenant, '
     'conversation_id)'),
    ('{"prompt": "a", "max_tokens": 0}', "p.jsonl:2: max_tokens must be at least 1, got 0"),
    ('{"prompt": "a",, }', "p.jsonl:2:16: not JSON: Expecting property name enclosed in double quotes"),
])
def test_a_bad_prompts_file_line_is_named(line, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("p.jsonl").write_text('{"prompt": "ok", "max_tokens": 3, "priority": 1}\n' + line + "\n")
    assert main(["generate", "--prompts-file", "p.jsonl"]) == 2
    assert capsys.readouterr().err == f"shunter generate: {message}\n"


def test_prompts_file_lines_carry_their_own_settings(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "def f", "max_tokens": 2, "priority": 3, "tenant": "a"}\n'
                    '{"prompt_ids": [5, 6], "max_tokens": 5, "request_class": null}\n')
    assert main(["generate", "--prompts-file", str(path), "--json", "--ignore-eos", "-v"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [len(r["token_ids"]) for r in lines] == [2, 5]
