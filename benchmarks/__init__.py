"""The benchmarks behind ``make bench`` (``python -m benchmarks``): a sibling of the runtime
packages, never installed with them. A full run writes ``docs/performance.md``."""
