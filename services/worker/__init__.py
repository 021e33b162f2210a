"""What only the engine workers (prefill, decode, colocated) use: the process around
the engine, its registration and reports, its shared-KV-tier client, the KV handoff."""
