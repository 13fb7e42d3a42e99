"""``ec-s3 demo``: an EPD stack (or, with ``--topology aggregated``, two ``ec_both``
servers) on one host with embedded S3 and a tiny model, that proves answers equal a
plain server's. ``run`` is the command and the order of its phases (``s3``, ``model``,
``baseline``, then ``epd`` or ``aggregated``), ``options`` its flags, ``context`` what the
phases share, ``chat`` the requests, ``report`` the EPD summary, ``fleet_report`` the
aggregated one. Never imported by the connector."""
