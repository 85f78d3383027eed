"""The inference side of pipeline-rl: one HTTP contract (docs/contract.md) in front of any engine.

    python -m inference_shim --model DIR --port 8000 [--backend vllm|sglang|capture]   # a server (cli.py)

    protocol.py       every wire model (torch-free), shared by server and clients
    client.py         the thin client of one server (sync and async)
    weight_sender.py  the trainer's half of a weight update (rank 0), transfer.py the collectives both sides run
    server.py         the FastAPI app; backends/ one file per engine behind the Backend template
    procs.py          child processes: ports, start in own session, wait healthy, stop a tree, the server argv
It imports nothing from `pipeline_rl`: an outside trainer can use the server, client and sender alone.
"""
