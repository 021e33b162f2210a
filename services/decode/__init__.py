"""The decode service: owns a request from placement to its last token. In
the colocated role it prefills and decodes; in the decode role it has long
prompts prefilled by a prefill worker and imports their KV blocks."""
