"""The text of one generated output as its tokens arrive: incremental
decoding (whole UTF-8 characters only), stop strings (the text is cut before
the stop string, or after it when asked), and the hold-back that keeps a
streamed piece from showing the start of a stop string before it is known.

Used by the engine and, in the mesh, by the gateway, which detokenizes.
"""

from __future__ import annotations

from basis.sampling_params import SamplingParams


class TextStream:
    def __init__(self, tokenizer, params: SamplingParams):
        self.params = params
        self._decoder = tokenizer.stream(params.skip_special_tokens) if tokenizer else None
        self.text = ""
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def append(self, token_id: int, num_output_tokens: int) -> str | None:
        """Adds one token's text; returns the stop string it completed, if any
        (the text is then final). Stop strings count only from min_tokens on."""
        piece = self._decoder.step(token_id) if self._decoder is not None else ""
        if not piece:
            return None
        before = len(self.text)
        self.text += piece
        if not self.params.stop or num_output_tokens < self.params.min_tokens:
            return None
        hit = _find_stop(self.text, before, self.params.stop)
        if hit is None:
            return None
        index, stop = hit
        cut = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:cut]
        return stop

    def visible(self, finished: bool) -> str:
        """Text safe to show: while unfinished, without what could begin a stop string."""
        if finished or not self._hold:
            return self.text
        return self.text[: max(0, len(self.text) - self._hold)]


def _find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newly added text."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, new_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
