"""The gateway: OpenAI-compatible REST and gRPC front door, auth, tokenization,
placement through the scheduler, and streaming detokenization."""
