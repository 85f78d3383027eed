"""What tests, benchmarks and diagnostics share: simulated hosts (network namespaces, root only), the
multi-host rig that runs processes on them, and model checkpoints built for tests.

Part of the installed package so that every user of it imports one copy; the product itself never
imports it (tests/unit/launch/test_layout.py checks that).
"""
