"""One module per `shunter` subcommand; each has `add_parser(subparsers)` and `run(args) -> int`."""
