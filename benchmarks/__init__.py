"""Benchmark scripts; a package so that rank processes can import benchmarks.step_clock."""
