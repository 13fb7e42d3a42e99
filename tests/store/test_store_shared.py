"""S3Store.shared: one store per configuration, and credentials are part of it.

It once keyed its cache on a repr with the secrets masked, so a second config that
differed only in credentials got the first one's client and its keys.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ec_s3.config import ECS3Config
from ec_s3.store.client import AccessDenied, S3Store


@pytest.mark.parametrize("first", ["good", "bad"])
def test_configs_differing_only_in_credentials_do_not_share(make_config: Callable[..., ECS3Config], first: str) -> None:
    configs = {"good": make_config(), "bad": make_config(secret_access_key="wrong-secret-value")}
    order = [first, "bad" if first == "good" else "good"]
    stores = {name: S3Store.shared(configs[name]) for name in order}
    try:
        good, bad = stores["good"], stores["bad"]
        assert good.run(good.head_async("missing"), timeout=30) is None  # a 404: these keys work
        with pytest.raises(AccessDenied):
            bad.run(bad.head_async("missing"), timeout=30)
        assert good is not bad
    finally:
        for store in stores.values():
            store.close()


def test_equal_configs_share_one_store_and_the_key_hides_secrets(make_config: Callable[..., ECS3Config]) -> None:
    config = make_config()
    a, b = S3Store.shared(config), S3Store.shared(make_config())
    try:
        assert a is b
        assert config.secret_access_key is not None
        secret = config.secret_access_key.reveal()
        assert secret not in repr(a._shared_key) and secret not in repr(a)
    finally:
        a.close()
        b.close()
