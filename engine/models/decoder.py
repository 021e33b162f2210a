"""One decoder-only transformer covering Llama, Qwen2, Qwen3, Mixtral,
Qwen3-MoE and DeepSeek-V2/V3: the differences are switches read from the
ModelConfig (q/k/v bias, per-head q/k norm, routed experts in some layers,
latent attention and shared experts in `mla.py` / `deepseek_moe.py`; the layers
themselves in `layers.py`).

Tokens of the whole step are laid out flat ([T, hidden]); the attention
backend and its metadata know which rows belong to which sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from basis.model_config import ModelConfig
from engine.attention import AttentionBackend, AttentionMetadata
from engine.expert_backend import LOCAL_EXPERTS, ExpertBackend
from engine.micro_batch import MicroBatchPolicy, run_micro_batches
from engine.models.deepseek_moe import DeepseekMoE
from engine.models.layers import MLP, Attention, RMSNorm, SparseMoE
from engine.models.mla import MLAttention
from engine.models.mtp import MultiTokenPredictor, mtp_config
from engine.parallel import comm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_mla:  # DeepSeek
            self.self_attn = MLAttention(config, RMSNorm)
            if config.is_moe_layer(index):
                self.mlp = DeepseekMoE(config)
                self.mlp.layer_index = index
            else:
                self.mlp = MLP(config.hidden_size, config.intermediate_size)
            return
        self.self_attn = Attention(config)
        if config.is_moe_layer(index):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        if isinstance(self.mlp, SparseMoE):
            self.mlp.layer_index = index

    def forward(self, x, residual, positions, cos_sin, cache, meta, backend):
        h, residual = self.attend(x, residual, positions, cos_sin, cache, meta, backend)
        return self.mlp(h), residual

    def attend(self, x, residual, positions, cos_sin, cache, meta, backend):
        """Everything before the MLP: norms, attention, the residual add."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, cos_sin, cache, meta, backend)
        return self.post_attention_layernorm.add_forward(h, residual)


class CausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_range: tuple[int, int] | None = None, mtp: bool = False
    ):
        """`layer_range`: a pipeline stage's layers; the first stage embeds, the last has
        the final norm and the LM head. `mtp`: with DeepSeek-V3's multi-token prediction
        layer (`mtp.py`), for speculative decoding."""
        super().__init__()
        self.config = config
        first, stop = layer_range or (0, config.num_hidden_layers)
        embeds, heads = first == 0, stop == config.num_hidden_layers
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Parameter(torch.empty(shape)) if embeds else None
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(first, stop))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if heads else None
        if not heads:
            self.lm_head = None
        elif config.tie_word_embeddings and embeds:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(torch.empty(shape))
        # the shape only: the model is built on the meta device and build_model sets the
        # table (computing it there would dispatch through torch's reference ops, whose
        # first use imports torch._dynamo: 2 s of CPU in every engine process)
        rows, width = config.max_position_embeddings, config.head_dim
        self.register_buffer("cos_sin", torch.empty(rows, width), persistent=False)
        self.full_vocab_size = config.vocab_size  # a tensor-parallel rank's is a slice
        self.mtp = None
        if mtp:
            block = DecoderLayer(mtp_config(config), config.num_hidden_layers)
            self.mtp = MultiTokenPredictor(config, block)
        self.experts: ExpertBackend = LOCAL_EXPERTS
        self.micro_batching: MicroBatchPolicy | None = None  # ping-pong micro-batches
        self._fp32_logits = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        layer_hook=None,
    ) -> torch.Tensor:
        """Returns the final hidden states, [T, hidden]. A step with enough tokens
        runs as micro-batches (`micro_batch.py`) when the policy is set. `layer_hook`,
        when given, is called with a layer's index once every row has written its KV."""
        parts = None
        if self.micro_batching is not None and not _capturing(input_ids):
            parts = self.micro_batching.split(meta)
        self.experts.begin_step()
        try:
            return run_micro_batches(
                self, input_ids, positions, kv_caches, meta, backend, parts, layer_hook
            )
        finally:
            self.experts.end_step()

    def layer_stream(self, input_ids, positions, kv_caches, meta, backend, layer_done):
        """A generator over the layers of one (micro-)batch that yields while its
        tokens are with the experts; returns the final hidden states."""
        x = comm.vocab_embedding(input_ids, self.embed_tokens, self.full_vocab_size)
        residual = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer.attend(x, residual, positions, self.cos_sin, cache, meta, backend)
            if isinstance(layer.mlp, SparseMoE):
                sent = layer.mlp.dispatch(h)
                yield
                x = layer.mlp.combine(sent)
            else:
                x = layer.mlp(h)
            layer_done(i)
        x, _ = self.norm.add_forward(x, residual)
        return x

    def forward_stage(self, input_ids, carried, positions, kv_caches, meta, backend):
        """One pipeline stage's layers, from the token ids (the first stage) or the
        previous stage's (hidden, residual); returns (hidden, residual), or on the last
        stage the final hidden states."""
        if carried is None:
            x = comm.vocab_embedding(input_ids, self.embed_tokens, self.full_vocab_size)
            residual = None
        else:
            x, residual = carried
        self.experts.begin_step()
        try:
            for layer, cache in zip(self.layers, kv_caches):
                x, residual = layer(x, residual, positions, self.cos_sin, cache, meta, backend)
        finally:
            self.experts.end_step()
        if self.norm is None:
            return x, residual
        x, _ = self.norm.add_forward(x, residual)
        return x

    def set_expert_backend(self, experts: ExpertBackend) -> None:
        """Where every MoE layer's routed experts run from the next step on."""
        self.experts = experts
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.experts = experts

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits. On CUDA with 16-bit weights the product accumulates into
        float32 directly, so two candidates are not tied merely because their logits
        round to the same bf16 value (greedy choices then compare across kernels)."""
        logits = None
        if hidden.is_cuda and hidden.dtype != torch.float32 and self._fp32_logits:
            try:
                logits = torch.mm(hidden, self.lm_head.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # an older torch: round through bf16
                self._fp32_logits = False
        if logits is None:
            logits = F.linear(hidden, self.lm_head).float()
        # tensor parallel: each rank has a slice of the vocabulary; the first samples
        return comm.gather_logits(logits, self.full_vocab_size)

    def expert_load(self) -> torch.Tensor | None:
        """Per MoE layer, tokens routed to each expert since the last call; resets."""
        loads = [layer.mlp.expert_load for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        if not loads:
            return None
        out = torch.stack(loads).cpu()
        for load in loads:
            load.zero_()
        return out


def _capturing(x: torch.Tensor) -> bool:
    """Inside a CUDA graph capture (which records one whole-batch schedule)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
