"""`python -m benchmarks NAME [options]`: see benchmarks/run.py."""

from benchmarks.run import main

main()
