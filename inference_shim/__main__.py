"""`python -m inference_shim --model DIR --port N ...`: run an inference server (flags: inference_shim/cli.py)."""

from inference_shim.cli import main

if __name__ == "__main__":
    main()
