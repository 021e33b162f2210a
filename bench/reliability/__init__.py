"""Reliability drills on a CPU mesh, run by hand (not in CI): `chaos` (kill -9 of
each service under concurrent streams) and `soak` (mixed traffic for a long
time, memory per service). `rounds` is the stream driver both use."""
