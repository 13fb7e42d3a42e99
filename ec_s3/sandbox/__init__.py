"""Local stand-ins for a real deployment, used by the demo, the tests and the
benches: an embedded S3 server, a tiny offline model, vLLM server processes, process
groups and the offline CPU environment. Never imported by the connector."""
