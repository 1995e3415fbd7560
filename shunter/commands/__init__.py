"""One module per `shunter` subcommand; each has `add_parser(subparsers)` and `run(args) -> int`.

`shunter --help` imports every module here to build its parser, so each `run` function (and
what only it calls) imports its heavy modules itself: torch (the model, the profiler), Lark
(the policy compiler), numpy, trio and the bench harness load only when their command runs.
"""
