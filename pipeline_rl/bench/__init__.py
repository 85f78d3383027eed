"""Benchmarks of pipeline-rl (issue 6), run with `pipeline-rl bench NAME [--quick]` (pipeline_rl/bench/run.py).

    common.py        options, statistics, tables, the docs/benchmarks.md section writer
    servers.py       start/stop real servers (our shim, vLLM's OpenAI server); a shared pool
    models.py        bench models of ~0.3/10/100/500 MB, cached in artifacts/bench-models/
    load.py          closed-loop client load with per-chunk timing
    pusher.py        a stand-in trainer process that pushes weights on command
    gloo_ceiling.py  the raw gloo broadcast ceiling (plain processes)
    weight_sync.py, inflight.py, streams.py, shim.py    benchmarks 1, 2, 4, 5
Results and method: docs/benchmarks.md.
"""
