"""The tuned MLA decode launches at 16 heads, three calls at each bench.gpu.mla case, for a
profiler run on a device machine (the kernel choices come from YINIAN_KERNEL_CACHE):
    ncu --section SpeedOfLight -k regex:"mla|reduce" python -m bench.gpu.ncu.mla_decode"""

import torch

from bench.gpu.mla import SCALE, case_cache, case_queries
from kernels.mla_decode import mla_decode_attention

for batch, context in [(64, 4096), (8, 32768)]:
    cache, tables, lens = case_cache(batch, context, 16, torch.bfloat16, "cuda")
    q_latent, q_pe = case_queries(batch, 16, torch.bfloat16, "cuda")
    for _ in range(3):
        mla_decode_attention(q_latent, q_pe, cache, tables, lens, SCALE, context)
    torch.cuda.synchronize()
