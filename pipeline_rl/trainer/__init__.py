"""Trainer side of pipeline-rl: RL objectives (losses.py), forward/backward, optimizer step, weight sync."""
