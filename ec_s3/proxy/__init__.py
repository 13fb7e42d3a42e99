"""``ec-s3 proxy``: the EPD front that fans media out to encoders and sends the request
to prefill/decode at the same time (items named by content, marked pending) or after
them (with their ``ec_transfer_params``). aiohttp only; never imports vLLM or the
connector.

Owns only this package's name: it imports none of its modules, so ``ec-s3`` can name the
proxy without loading it. Does not own the app (:mod:`.server`), its routes (:mod:`.chat`,
:mod:`.status`), dispatch (:mod:`.dispatch`) or the command line (:mod:`.main`).
"""
