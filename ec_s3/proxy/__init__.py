"""``ec-s3 proxy``: the EPD front that fans media out to encoders and forwards
``ec_transfer_params`` to prefill/decode. aiohttp only; never imports vLLM or the
connector.

Modules: :mod:`.config` (settings), :mod:`.media` (reading and rewriting request
bodies, no I/O), :mod:`.upstreams` (pools, cooldown), :mod:`.metrics` (``/metrics``),
:mod:`.server` (the aiohttp app, :class:`~ec_s3.proxy.server.EPDProxy`,
:class:`~ec_s3.proxy.server.ProxyThread`), :mod:`.main` (the command line). This
package file imports none of them, so ``ec-s3`` can name the proxy without loading it.
"""
