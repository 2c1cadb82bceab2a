"""The store options take one path from the command line to SGLang's adapters: every field
that travels arrives unchanged, and the token never travels in an argv or a config."""

from __future__ import annotations

import dataclasses
import json

from banaserve.config.store_options import KvStoreOptions

OPTIONS = KvStoreOptions([], True, "secret-token", 2, 3.0, "tenant a", "linker", 7.5)
URLS = ["tcp://h:1", "shm://h:2"]
#: What reaches an instance's adapters: the cluster's shard urls; no token (the environment
#: carries it), no capacity (the embedded shard's own).
ARRIVES = dataclasses.replace(OPTIONS, urls=URLS, embedded=False, token=None, capacity_gb=2.0)


def extra_of(argv: list[str], flag: str) -> dict:
    return json.loads(argv[argv.index(flag) + 1])


def test_options_reach_the_hicache_backend_unchanged() -> None:
    from banaserve.sglang_ext.kvstore_backend import hicache_args

    argv = hicache_args(OPTIONS, URLS)
    assert "secret-token" not in " ".join(argv)
    extra = extra_of(argv, "--hicache-storage-backend-extra-config")
    assert KvStoreOptions.from_extra(extra) == ARRIVES


def test_options_reach_the_linker_unchanged() -> None:
    from banaserve.sglang_ext.kvstore_linker import linker_args

    argv = linker_args(OPTIONS, URLS)
    assert "secret-token" not in " ".join(argv)
    extra = extra_of(argv, "--unified-cache-external-linker-config")["linker_extra_config"]
    assert KvStoreOptions.from_extra(extra) == ARRIVES


def test_an_empty_extra_config_gives_the_flags_defaults() -> None:
    from banaserve.config.cli import build_parser

    args = build_parser().parse_args(["--kv-store", "tcp://h:1"])
    assert KvStoreOptions.from_extra({"urls": ["tcp://h:1"]}) == KvStoreOptions.from_args(args)


def test_extra_config_values_are_converted_to_the_fields_types() -> None:
    options = KvStoreOptions.from_extra({"urls": URLS, "replication": "2", "coalesce_wait_s": 1})
    assert options.replication == 2 and options.coalesce_wait_s == 1.0
    assert isinstance(options.coalesce_wait_s, float)


def test_the_linkers_tuning_values_travel_as_extra_config_and_have_no_flag() -> None:
    from banaserve.config.cli import build_parser
    from banaserve.sglang_ext.kvstore_linker import linker_args

    tuned = dataclasses.replace(OPTIONS, lookup_wait_s=0.25, load_depth=2, layer_store_bytes=0)
    extra = extra_of(linker_args(tuned, URLS), "--unified-cache-external-linker-config")
    arrived = KvStoreOptions.from_extra(extra["linker_extra_config"])
    assert (arrived.lookup_wait_s, arrived.load_depth, arrived.layer_store_bytes) == (0.25, 2, 0)
    flags = {o for action in build_parser()._actions for o in action.option_strings}
    assert not {"--kv-store-lookup-wait-s", "--kv-store-load-depth"} & flags
