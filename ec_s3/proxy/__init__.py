"""``ec-s3 proxy``: the EPD front that fans media out to encoders and forwards
``ec_transfer_params`` to prefill/decode. aiohttp only; never imports vLLM or the
connector."""
