"""``ec-s3``: the operator's command line (check, stats, gc, inspect, bench, and the
proxy and demo pass-throughs). Never imported by the connector."""
