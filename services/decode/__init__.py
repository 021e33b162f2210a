"""The decode service: the engine behind gRPC. In the colocated role it
prefills and decodes; in the decode role it imports KV from a prefill worker."""
