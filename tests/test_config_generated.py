"""The committed job_pb2.py and common_pb2.py are exactly what scripts/gen_proto.py generates."""
import importlib.util

import pytest
from conftest import REPO


@pytest.mark.parametrize("proto", ["job.proto", "common.proto"])
def test_generated_module_is_fresh(proto):
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    module = proto.replace(".proto", "_pb2.py")
    committed = (REPO / "src" / "shoal" / "config" / module).read_text()
    assert gen.generated_text(proto) == committed, f"{module} is stale: run `python scripts/gen_proto.py`"
