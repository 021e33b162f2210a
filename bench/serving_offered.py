"""The rate each client offered in a `bench.gpu.serving --third-party` sweep: ours
from its runs' per-request `start_times`, guidellm's from its reports' requests
(`request_start`), both through `bench.loadgen.metrics.offered_rate`, beside each
client's p99 figures. For sweeps made before the rows carried `offered_rate`.

Usage: python -m bench.serving_offered SERVING.json OURS.tgz GUIDELLM.tgz
  OURS.tgz: the sweep's sweep-rate<R>.json files; GUIDELLM.tgz: guidellm/guidellm-rate<R>.json
"""

from __future__ import annotations

import json
import sys
import tarfile

from bench.loadgen.guidellm_run import rows_of
from bench.loadgen.metrics import offered_rate


def member(archive: tarfile.TarFile, suffix: str) -> dict:
    (name,) = [n for n in archive.getnames() if n.endswith(suffix)]
    return json.load(archive.extractfile(name))


def main(argv: list[str] | None = None) -> None:
    serving, ours_tgz, theirs_tgz = argv or sys.argv[1:]
    serve = json.load(open(serving))["serve"]
    ours, theirs = tarfile.open(ours_tgz), tarfile.open(theirs_tgz)
    print("| named | ours sent/s | guidellm sent/s | ours TTFT p99 / TPOT p99 ms | "
          "guidellm TTFT p99 / TPOT p99 ms |")  # fmt: skip
    print("|---|---|---|---|---|")
    gl = {r["request_rate"]: r for r in serve["third_party"]["sweep"]}
    for a in serve["sweep"]:
        rate = a["request_rate"]
        sent = offered_rate(member(ours, f"sweep-rate{rate:g}.json")["start_times"])
        (t,) = rows_of(member(theirs, f"guidellm-rate{rate:g}.json"))
        b = gl[rate]
        print(f"| {rate:g} | {sent:.1f} | {t['offered_rate']:.1f} | "
              f"{a['p99_ttft_ms']:.1f} / {a['p99_tpot_ms']:.1f} | "
              f"{b['p99_ttft_ms']:.1f} / {b['p99_tpot_ms']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
