"""Where the repository's data lives: the one home of the paths every module needs.

`conf/` (YAML configs, accelerate and DeepSpeed files) sits at the repository root, beside the packages;
pipeline-rl runs from a checkout (`make setup` installs it editable), so these resolve from this file.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
