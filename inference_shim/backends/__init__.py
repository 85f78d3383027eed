"""Engine backends behind the contract: base.py (the interface and the weight-update lifecycle template),
vllm_backend.py (in-process vLLM), sglang_backend.py (+ sglang_process.py, sglang_client.py: a private SGLang
server driven through its native endpoints), capture_backend.py (no engine: receives and keeps pushed weights).
"""
