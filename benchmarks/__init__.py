"""The benchmark suite (``python -m benchmarks QUESTION``); see benchmarks/__main__.py."""
