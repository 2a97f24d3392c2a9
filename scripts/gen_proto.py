"""Regenerate src/shoal/config/{job,common}_pb2.py from job.proto and common.proto.

Uses the protoc bundled with grpcio-tools (pinned in requirements-dev.txt), so
the output is the same on every machine. tests/test_config_generated.py fails
when a committed module is stale.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "src" / "shoal" / "config"
PROTOS = ("job.proto", "common.proto")


def generate(out_dir: Path, proto: str = "job.proto") -> Path:
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{CONFIG_DIR}", f"--python_out={out_dir}", str(CONFIG_DIR / proto)])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    target = out_dir / proto.replace(".proto", "_pb2.py")
    # protoc imports a dependency as a top-level module (`import job_pb2`); ours live in shoal.config
    target.write_text(re.sub(r"^import (\w+_pb2) as", r"from shoal.config import \1 as", target.read_text(), flags=re.M))
    return target


def generated_text(proto: str = "job.proto") -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return generate(Path(tmp), proto).read_text()


if __name__ == "__main__":
    for proto in PROTOS:
        target = CONFIG_DIR / proto.replace(".proto", "_pb2.py")
        target.write_text(generated_text(proto))
        print(f"wrote {target}", file=sys.stderr)
