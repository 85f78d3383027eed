"""The process a sandboxed tool call runs in (pipeline_rl/tasks/sandbox.py starts it, limits and all):

    python -I sandbox_child.py TOOL_FILE FUNCTION < arguments.json

Loads FUNCTION from TOOL_FILE, calls it with the JSON object on stdin as keyword arguments and writes
its result (as text) to stdout. An exception is one line `Type: message` on stderr and exit status 1.
Standard library only: `-I` leaves this process no project packages to import.
"""

import importlib.util
import json
import sys


def main() -> int:
    path, function = sys.argv[1], sys.argv[2]
    try:
        arguments = json.load(sys.stdin)
        if not isinstance(arguments, dict):
            raise TypeError("the arguments must be a JSON object")
        spec = importlib.util.spec_from_file_location("tool", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result = getattr(module, function)(**arguments)
        sys.stdout.write(str(result))
    except BaseException as e:  # noqa: BLE001 - every failure is an observation for the model
        sys.stderr.write(f"{type(e).__name__}: {e}"[:500] + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
