"""The KV block store: the shared tier (whole blocks in memory and Redis, per
tenant and model, with leases, quotas and verification). Which worker holds
which block is the scheduler's index, the mesh's only one."""
