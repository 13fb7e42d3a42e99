"""``ec-s3``: the operator's command line (check, stats, gc, inspect, bench, and the
proxy and demo pass-throughs), one module per command family; :mod:`ec_s3.cli.main`
is the entry point. Owns no part of the data path and is never imported by the
connector."""
