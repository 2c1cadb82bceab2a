"""Small helpers shared by the launcher, the tests and the benchmarks."""
