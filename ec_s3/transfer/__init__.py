"""The vLLM-free data path: uploads (publisher, spool), lookups and downloads
(fetcher) into host staging memory (staging), the copies between host and device
(device), and the counters they keep.

Owns bytes in flight and their bounds. Does not import vLLM, decide what a request
needs (``ec_s3.connector``) or speak S3 (``ec_s3.store``).
"""
