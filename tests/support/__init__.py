"""What tests share: starting real servers (servers.py), an in-process capture server (capture.py),
launched runs and their checks (launching.py), trainer inputs (training.py), load clients, stand-ins
for what cannot run here (sglang_standin.py), the fake backend of the shim's unit tests, and the
process that plays the trainer on a simulated host. tests/conftest.py puts tests/ on sys.path, so a
test imports `from support.servers import ...`."""
