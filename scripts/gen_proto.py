"""Regenerate src/shoal/config/job_pb2.py from job.proto.

Uses the protoc bundled with grpcio-tools (pinned in requirements-dev.txt), so
the output is the same on every machine. tests/test_config_generated.py fails
when the committed module is stale.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "src" / "shoal" / "config"


def generate(out_dir: Path) -> Path:
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{CONFIG_DIR}", f"--python_out={out_dir}", str(CONFIG_DIR / "job.proto")])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return out_dir / "job_pb2.py"


def generated_text() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return generate(Path(tmp)).read_text()


if __name__ == "__main__":
    target = CONFIG_DIR / "job_pb2.py"
    target.write_text(generated_text())
    print(f"wrote {target}", file=sys.stderr)
