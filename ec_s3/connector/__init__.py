"""What vLLM loads: the ``ECConnectorBase`` façade and its scheduler and worker roles.

Owns the vLLM contract (hooks, metadata between scheduler and workers, metrics
plumbing, per-item admission state). Does not own bytes in flight (``ec_s3.transfer``),
the S3 protocol (``ec_s3.store``) or the blob format (``ec_s3.blob``), and never imports
a tool (``cli``, ``proxy``, ``demo``, ``sandbox``).
"""
