"""`shunter policy check FILE...` and `shunter policy explain FILE`."""

from __future__ import annotations

import argparse
from engine.errors import PolicyCheckError, PolicyError, PolicySyntaxError
from policies import find_policy


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="check or explain policy files",
                       description="Work with .policy files without starting an engine.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check", help="check the language of policy files",
        description="Print `FILE: ok` for each good file (exit 0), or each error as "
                    "FILE:LINE:COL: message with the source line and a caret (exit 2). Checks "
                    "the language only, not whether this engine has every mechanism a file asks "
                    "for (that is checked when an engine loads it).")
    check.add_argument("files", nargs="+", metavar="FILE|NAME",
                       help="policy files, or names of shipped policies")
    check.set_defaults(run=run_check)
    explain = actions.add_parser("explain", help="say what a policy does, in plain words")
    explain.add_argument("file", metavar="FILE|NAME",
                         help="a policy file, or the name of a shipped policy")
    explain.set_defaults(run=run_explain)


def run_check(args: argparse.Namespace) -> int:
    from policy_lang import load_policy_file

    failed = False
    for spec in args.files:
        try:
            path = find_policy(spec)
            load_policy_file(path)
        except (PolicySyntaxError, PolicyCheckError) as exc:
            print(exc)
            failed = True
        except PolicyError as exc:
            print(exc)
            failed = True
        else:
            print(f"{spec}: ok")
    return 2 if failed else 0


def run_explain(args: argparse.Namespace) -> int:
    from policy_lang import load_policy_file

    print(load_policy_file(find_policy(args.file)).explain(), end="")
    return 0
