"""Benchmarks: `make bench` (python -m benchmarks.run). Each bench_<topic>.py has run() -> markdown."""
