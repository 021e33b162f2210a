"""The PD scheduler: worker registry, KV-aware and load-aware placement."""
