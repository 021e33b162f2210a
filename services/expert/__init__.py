"""The MoE expert service: expert weights of every MoE layer, computing the
tokens workers route to them."""
