"""The gateway: OpenAI-compatible REST and gRPC front door, auth, tokenization,
placement (its own, from the mesh's NATS events, or through the scheduler), and
streaming detokenization."""
