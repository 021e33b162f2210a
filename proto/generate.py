"""Regenerates the Python stubs from the .proto files: `python -m proto.generate`.

Stubs land beside their .proto (proto/yinian/v1/*_pb2.py, *_pb2_grpc.py,
*_pb2.pyi). `--out DIR` writes them elsewhere (the staleness test uses it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def proto_files() -> list[Path]:
    return sorted((ROOT / "proto").rglob("*.proto"))


def generate(out: Path = ROOT) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    generated = []
    for package in sorted({p.parent for p in proto_files()}):
        target = out / package.relative_to(ROOT)
        # Make every folder from `out` down to the stubs an importable package.
        folder = target
        while folder != out and out in folder.parents:
            (folder / "__init__.py").touch()
            folder = folder.parent
        generated += sorted(target.glob("*_pb2*.py*"))
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
