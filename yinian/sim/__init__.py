"""`yinian sim`: many simulated workers placed by the scheduler's own code, on the
simulation's clock (see cluster.py)."""
