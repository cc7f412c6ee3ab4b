"""Performance benchmarks: every check against what reading its data once costs.

`python -m benchmarks` runs them all and prints each figure next to its target; see
docs/performance.md.
Each figure is a ratio measured within one run, with the two sides interleaved, because the
machines these run on are shared and their load changes from second to second.
"""
