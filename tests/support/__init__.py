"""Test and benchmark support: the real vLLM Scheduler rig, the connector harness and
the HTTP fault proxy. Imported by ``tests/`` and ``bench/``; never by ``ec_s3``."""
