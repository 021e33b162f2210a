"""The paged MLA decode kernel's candidates one by one on one GPU (what the kernel
selector chooses among in bench/gpu/mla.py's decode_kernel section): each variant
and launch config at each (batch, context) and head count, as a fraction of the copy
bandwidth and of a read-only pass over the same cache (torch's sum); then, for the
fastest candidate of each variant at the first head count, every split count.

Usage: python -m bench.gpu.mla_sweep --out FILE [--skip NAME ...] [--device cpu]
           [--heads N ...] [--variants NAME ...]
Sections: ceilings, candidates, splits. `--device cpu` is a dry run at tiny sizes
through Triton's interpreter (float16, two candidates of each variant).
"""

from __future__ import annotations

import torch

from bench.gpu.ceilings import measure
from bench.gpu.mla import SCALE, case_cache, case_queries, kernel_row
from bench.gpu.sections import Sections, script_parser
from bench.gpu.timing import queued_ms

GPU = dict(cases=[(64, 4096), (8, 32768)], heads=[16, 128], block_size=16,
           splits=(1, 2, 4, 8, 16, 32, 64), per_variant=None)  # fmt: skip
CPU = dict(cases=[(2, 40)], heads=[4], block_size=16, splits=(1, 2), per_variant=2)


def pool(device: str, per_variant: int | None, variants: list[str] | None = None):
    """The selector's candidates of the variants asked for (on the CPU, each variant's
    first few)."""
    from kernels.mla_decode import SELECTOR

    found = SELECTOR.candidates if device == "cpu" else SELECTOR.usable(torch.device(device))
    found = [c for c in found if variants is None or c.variant in variants]
    if per_variant is None:
        return SELECTOR, found
    firsts = [[c for c in found if c.variant == v][:per_variant] for v in SELECTOR.variants]
    return SELECTOR, [c for few in firsts for c in few]


class Case:
    """One (batch, context, heads): inputs, the reference output, the read-only time."""

    def __init__(self, batch, context, heads, sizes, device):
        from kernels.mla_reference import mla_decode

        dtype = torch.bfloat16 if device == "cuda" else torch.float16
        self.cache, tables, lens = case_cache(batch, context, sizes["block_size"], dtype, device)
        q_latent, q_pe = case_queries(batch, heads, dtype, device)
        self.args = (q_latent, q_pe, self.cache, tables, lens, SCALE, context)
        self.out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
        self.want = mla_decode(*self.args[:6]).float()
        self.shape, self.device = (batch, context, heads), device

    def run(self, selector, candidate, **extra) -> float:
        """Relative error of one launch, then its queued time in ms."""

        def launch():
            kwargs = {**candidate.kwargs, **extra}
            return selector.variants[candidate.variant](*self.args, self.out, **kwargs)

        error = ((launch().float() - self.want).abs().max() / self.want.abs().max()).item()
        return error, queued_ms(launch, self.device)

    def row(self, ms: float, ceilings: dict, read_ms: float) -> dict:
        row = kernel_row(*self.shape, ms, self.cache.element_size(), ceilings)
        row["fraction_of_read_pass"] = read_ms / ms
        return row


def read_pass_ms(cache: torch.Tensor, device: str) -> float:
    return queued_ms(lambda: cache.sum(dtype=torch.float32), device)


def candidates(sizes: dict, ceilings: dict, device: str) -> list[dict]:
    selector, found = pool(device, sizes["per_variant"], sizes.get("variants"))
    rows = []
    for heads in sizes["heads"]:  # the first head count's every case first
        for batch, context in sizes["cases"]:
            case = Case(batch, context, heads, sizes, device)
            read_ms = read_pass_ms(case.cache, device)
            for candidate in selector.suiting(found, case.args):
                label = {"variant": candidate.variant, "config": candidate.kwargs}
                try:
                    error, ms = case.run(selector, candidate)
                except Exception as exc:  # a config this device cannot run: noted, not fatal
                    rows.append({**label, "batch": batch, "context": context, "heads": heads,
                                 "error": repr(exc)[:300]})  # fmt: skip
                    continue
                row = {**label, **case.row(ms, ceilings, read_ms), "max_rel_error": error}
                rows.append(row)
                print(f"B={batch} ctx={context} H={heads} {candidate.variant} "
                      f"{candidate.kwargs}: {ms:.4f} ms, {row['fraction_of_copy_bandwidth']:.3f}"
                      f" of copy, {row['fraction_of_read_pass']:.3f} of a read pass, "
                      f"{row['tflops']:.0f} TFLOP/s, err {error:.1e}", flush=True)  # fmt: skip
            del case
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def splits(sizes: dict, ceilings: dict, device: str, found_rows: list[dict]) -> list[dict]:
    """The fastest candidate of each variant at the first head count, at every split count."""
    selector, found = pool(device, sizes["per_variant"], sizes.get("variants"))
    heads, rows = sizes["heads"][0], []
    for batch, context in sizes["cases"]:
        case = Case(batch, context, heads, sizes, device)
        read_ms = read_pass_ms(case.cache, device)
        for variant in selector.variants:
            shape = (batch, context, heads)
            timed = [r for r in found_rows if r.get("variant") == variant and "ms" in r
                     and (r["batch"], r["context"], r["heads"]) == shape]  # fmt: skip
            if not timed:
                continue
            best = min(timed, key=lambda r: r["ms"])
            candidate = next(c for c in found if c.variant == variant
                             and c.kwargs == best["config"])  # fmt: skip
            for count in sizes["splits"]:
                error, ms = case.run(selector, candidate, num_splits=count)
                row = {"variant": variant, "config": best["config"], "num_splits": count,
                       **case.row(ms, ceilings, read_ms), "max_rel_error": error}  # fmt: skip
                rows.append(row)
                print(f"B={batch} ctx={context} H={heads} {variant} splits {count}: "
                      f"{ms:.4f} ms, {row['fraction_of_copy_bandwidth']:.3f} of copy",
                      flush=True)  # fmt: skip
        del case
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--heads", type=int, nargs="+", help="head counts (default: all)")
    parser.add_argument("--variants", nargs="+", help="variants (default: all)")
    args = parser.parse_args(argv)
    sizes = dict(GPU if args.device == "cuda" else CPU, variants=args.variants)
    sizes["heads"] = args.heads or sizes["heads"]
    with Sections(args, script="mla_sweep") as section:
        ceilings = section("ceilings", lambda: measure(args.device))
        if ceilings is None:
            raise SystemExit("no ceilings, nothing to compare against")
        rows = section("candidates", lambda: candidates(sizes, ceilings, args.device)) or []
        section("splits", lambda: splits(sizes, ceilings, args.device, rows))
        return section.results


if __name__ == "__main__":
    main()
