"""The committed job_pb2.py is exactly what scripts/gen_proto.py generates from job.proto."""
import importlib.util

from conftest import REPO


def test_generated_module_is_fresh():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (REPO / "src" / "shoal" / "config" / "job_pb2.py").read_text()
    assert gen.generated_text() == committed, "job_pb2.py is stale: run `python scripts/gen_proto.py`"
