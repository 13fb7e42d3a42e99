"""The S3 store: operations with retries, typed errors, the circuit breaker, request
bodies and diagnoses (cause + fix).

Imports neither torch nor vLLM, and nothing of ec-s3 above it: it moves opaque bytes
to and from keys it is given, and does not know what a blob or a request is.
"""
