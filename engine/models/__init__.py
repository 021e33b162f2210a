"""Model definitions: plain torch modules for the supported decoder-only
architectures, with Hugging Face weight names mapped onto fused parameters."""

from engine.models.decoder import CausalLM

__all__ = ["CausalLM"]
