"""KV block transports between workers: one interface, chosen per pair of
endpoints (cuda_ipc on one host, nccl across hosts, tcp as the fallback and
on CPU)."""
