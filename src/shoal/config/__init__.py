"""Job schema (job.proto), loaders for job.conf / job.yaml, and validation."""
from shoal.config import job_pb2

__all__ = ["job_pb2"]
