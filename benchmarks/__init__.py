"""Benchmarks of pipeline-rl: outside the installed package, run from a checkout.

    .venv/bin/python -m benchmarks NAME [options]    # one benchmark (benchmarks/run.py lists them)
    make bench                                         # every one, in order, sharing servers

Each prints its tables, writes its result as data (benchmarks/results/NAME.json) and regenerates
docs/benchmarks.md and the README's table of current figures from every results file (benchmarks/page.py).
Benchmarks use the public names of pipeline_rl and inference_shim only; nothing there imports this package.

    common.py        options, statistics, tables, the results writer
    servers.py       start/stop real servers (our shim, vLLM's OpenAI server); a shared pool
    models.py        bench models of ~0.3/10/100/500 MB, cached in artifacts/bench-models/
    load.py          closed-loop client load with per-chunk timing
    pusher.py        a stand-in trainer process that pushes weights on command
    gloo_ceiling.py  the raw gloo broadcast ceiling (plain processes)
    page.py          renders docs/benchmarks.md and the README's figures table from results/*.json
"""
