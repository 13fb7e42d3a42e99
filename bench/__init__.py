"""The ec-s3 benchmarks: ``python -m bench.run_all [--quick]`` from the repository root
runs them all; ``python -m bench.<name> --help`` one of them (see bench/README.md).

A package so that the scripts import their harness (:mod:`bench.benchlib`) and the
tests' rigs (``tests.support``) by name, without editing ``sys.path``. Owns nothing
ec-s3 runs; imports nothing itself.
"""
