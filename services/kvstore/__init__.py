"""The KV block store: the shared tier (whole blocks in Redis, per tenant and
model, with leases, quotas and verification) and the global index of which
worker holds which block."""
