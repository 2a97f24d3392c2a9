"""Job schema (job.proto), loaders for job.conf / job.yaml / dicts, `--set` overrides, and validation."""

from shoal.config import job_pb2
from shoal.config.errors import JobError, JobShapeError
from shoal.config.loader import job_from_dict, job_from_text, job_from_yaml, load_job
from shoal.config.overrides import apply_overrides
from shoal.config.phases import in_phase, layers_in_phase
from shoal.config.positions import SourceMap
from shoal.config.validate import validate, validate_cluster

__all__ = [
    "JobError",
    "JobShapeError",
    "SourceMap",
    "apply_overrides",
    "in_phase",
    "job_from_dict",
    "job_from_text",
    "job_from_yaml",
    "job_pb2",
    "layers_in_phase",
    "load_job",
    "validate",
    "validate_cluster",
]
