"""``ec-s3 proxy``: the EPD front that fans media out to encoders and sends the request
to prefill/decode at the same time (items named by content, marked pending) or after
them (with their ``ec_transfer_params``). aiohttp only; never imports vLLM or the
connector.

Modules: :mod:`.config` (settings), :mod:`.media` (reading and rewriting request
bodies, no I/O), :mod:`.naming` (content names, pending marks), :mod:`.dispatch`
(parallel or serial), :mod:`.upstreams` (pools, cooldown), :mod:`.metrics` (``/metrics``),
:mod:`.server` (the aiohttp app, :class:`~ec_s3.proxy.server.EPDProxy`,
:class:`~ec_s3.proxy.server.ProxyThread`), :mod:`.chat` and :mod:`.status` (its routes),
:mod:`.encode` and :mod:`.pd` (one send each), :mod:`.relay` (p/d's answer to the
client), :mod:`.main` (the command line). This package file imports none of them, so
``ec-s3`` can name the proxy without loading it.
"""
