"""The CPU demo: a tiny model built here (tiny_model.py), its supervised warm-up (warmup.py), and
`pipeline-rl demo` (main.py), which builds, warms up and launches RL on it."""
