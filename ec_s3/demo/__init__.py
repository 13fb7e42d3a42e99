"""``ec-s3 demo``: an EPD stack on one host (embedded S3, tiny model, producer,
consumer, proxy) that proves answers equal a plain server's. ``run`` is the command,
``chat`` the requests, ``report`` the summary. Never imported by the connector."""
