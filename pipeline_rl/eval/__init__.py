"""Held-out evaluation: greedy answers to a task's test problems, graded by the task, through the
servers while a run goes on (heldout.py) or in this process over a run's weight snapshots (snapshots.py)."""
