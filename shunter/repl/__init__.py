"""`shunter repl`: watch an in-process engine serve a synthetic workload and change its policy
while it runs. `session.py` is the command layer, `terminal.py` the readline front."""
