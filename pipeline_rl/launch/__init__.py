"""The launcher: `pipeline-rl launch [key=value ...]` composes the config (compose.py), plans and starts every
process of a run (main.py, processes.py), supervises and monitors it (monitor.py), evaluates (evaluate.py) and
reports (report.py); `pipeline-rl demo` (demo.py) builds the tiny model and runs the CPU demo.
"""
