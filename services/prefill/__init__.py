"""The prefill service: the engine in the prefill role. It computes prompts
under its own token budget, samples the first token, hands each prompt's KV
blocks to the decode worker that owns the request (layer by layer, while the
prompt is still being computed), and holds them under a lease until the
decode side has them."""
