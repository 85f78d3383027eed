"""The preprocessor role: rollout groups in, one training package per trainer rank out (main.py, the
process; ops.py, the pure transforms: advantages, filtering, truncation, packing)."""
