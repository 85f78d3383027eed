"""pipeline-rl: pipelined RL for LLMs with inflight weight updates (RL side)."""
