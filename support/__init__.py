"""What the tests and the benchmarks both run and neither owns (not part of the package):
:mod:`support.s3_server`, a real S3 API with injected faults."""
