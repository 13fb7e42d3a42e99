"""The S3 store: operations with retries (:mod:`.client`), typed errors (:mod:`.errors`) and
their one mapping from answers and transport exceptions (:mod:`.error_map`), the circuit breaker
(:mod:`.breaker`), request bodies (:mod:`.body`), the blob requests signed and sent here
(:mod:`.transport`, :mod:`.wire`), the aiobotocore client for the rest (:mod:`.connection`) and
diagnoses, a cause and a fix (:mod:`.diagnose`).

Imports neither torch nor vLLM, and nothing of ec-s3 above it: it moves opaque bytes
to and from keys it is given, and does not know what a blob or a request is.
"""
