"""The benchmarks behind ``make bench`` (``python -m benchmarks``): a sibling of the runtime
packages, never installed with them. See the README's Performance section."""
