"""The load generator behind `yinian bench serve` (any OpenAI-compatible server: datasets,
a timed streaming client, vLLM's metrics, plots) and `yinian bench engine` (the engine
offline, optionally against transformers)."""
