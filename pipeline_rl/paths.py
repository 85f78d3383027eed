"""Where the package's data lives: the one home of the paths every module needs.

`pipeline_rl/conf/` (YAML config groups, recipes, accelerate and DeepSpeed files) ships inside the package as
package data, so an installed wheel finds it as a checkout does. accelerate and DeepSpeed read these
files by path, hence a real directory (wheels are installed unpacked, never run from a zip).
"""

from importlib.resources import files
from pathlib import Path

CONF_DIR = Path(str(files("pipeline_rl") / "conf"))
