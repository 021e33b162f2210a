"""Pipeline stages: contiguous runs of layers, one per stage (each stage a
tensor-parallel group of ranks). Stage 0 embeds the tokens; the last stage
holds the final norm and the LM head and turns the sampled rows into logits.
Layers are split as evenly as they go, the earlier stages taking the extra
ones."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StagePlan:
    num_layers: int
    pp_size: int
    stage: int

    def __post_init__(self) -> None:
        if not 1 <= self.pp_size <= self.num_layers:
            raise ValueError(
                f"pipeline_parallel_size {self.pp_size} must be between 1 and the model's "
                f"{self.num_layers} layers"
            )
        if not 0 <= self.stage < self.pp_size:
            raise ValueError(f"stage {self.stage} of {self.pp_size}")

    @property
    def layers(self) -> tuple[int, int]:
        """[first, stop) of this stage's layers."""
        base, extra = divmod(self.num_layers, self.pp_size)
        first = self.stage * base + min(self.stage, extra)
        return first, first + base + (1 if self.stage < extra else 0)

    def owns(self, hf_name: str) -> bool:
        """Whether checkpoint tensor `hf_name` is loaded by this stage."""
        if hf_name.startswith("model.layers."):
            index = hf_name.split(".")[2]
            if index.isdigit():
                first, stop = self.layers
                return first <= int(index) < stop
        if hf_name.startswith("model.embed_tokens."):
            return self.stage == 0
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return self.stage == self.pp_size - 1
        return True
