"""Job schema (job.proto), loaders for job.conf / job.yaml, and validation."""
from shoal.config import job_pb2
from shoal.config.errors import JobError, JobShapeError
from shoal.config.loader import apply_overrides, job_from_dict, job_from_text, load_job
from shoal.config.validate import layers_in_phase, validate, validate_cluster

__all__ = [
    "job_pb2",
    "JobError",
    "JobShapeError",
    "apply_overrides",
    "job_from_dict",
    "job_from_text",
    "load_job",
    "layers_in_phase",
    "validate",
    "validate_cluster",
]
