"""Generates the gRPC stubs in services/common/pb from proto/*.proto (the one source of truth).

`python scripts/gen_protos.py` writes them; `--out DIR` writes elsewhere (the staleness test
compares a fresh generation with the committed files).
"""
import argparse
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto").glob("*.proto"))
PACKAGE_DIR = "services/common/pb"


def generate(out: pathlib.Path) -> None:
    """Runs protoc so that generated modules import each other as services.common.pb.*."""
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PACKAGE_DIR}={ROOT / 'proto'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[f"{PACKAGE_DIR}/{p.name}" for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT, help="root to write services/common/pb under")
    generate(parser.parse_args().out)
