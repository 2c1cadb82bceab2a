"""Every environment variable BanaServe reads or hands a child process, named once.

Pure names, no reads: each module that reads one imports its name from here, so a newcomer
finds what a child inherits in one place. SGLang's own variables that BanaServe sets for its
children are here too (the ``SGLANG_`` ones).
"""

#: ``cpu`` forces BanaServe's CPU platform, ``cuda`` forces it off, ``auto`` (the default)
#: decides from the driver.
PLATFORM_ENV = "BANASERVE_PLATFORM"
#: Where models are built or converted once (the tiny model, SmolLM2).
CACHE_ENV = "BANASERVE_CACHE_DIR"
#: The store's shared token, read by servers, clients and the launcher.
TOKEN_ENV = "BANASERVE_KV_STORE_TOKEN"
#: The tenant-token file's path, when the store server is not given ``--tenant-tokens``.
TENANT_TOKENS_ENV = "BANASERVE_KV_STORE_TENANT_TOKENS"
#: The smallest boundary a movable two-stage instance's second stage holds buffers for.
MOVABLE_ENV = "BANASERVE_PP_MIN_BOUNDARY"
#: A two-stage instance's split folder (its boundary record and the KV its stages share).
SPLIT_DIR_ENV = "BANASERVE_PP_SPLIT_DIR"
#: Tests only: an instance whose prompt contains this text crashes (supervision tests).
CRASH_ON_TEXT_ENV = "BANASERVE_TEST_CRASH_ON_TEXT"
#: The hostile-input probes: a directory to import the store servers' ``banaserve`` from.
SERVER_PATH_ENV = "BANASERVE_PROBE_SERVER_PATH"
#: SGLang's layer split of a pipeline-parallel instance ("k,L-k").
LAYER_PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"
#: SGLang's CPU thread binding, one core list per pipeline rank ("0|1").
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
#: How often SGLang's tokenizer manager looks whether a waiting request's client has left
#: (seconds; it then aborts the request).
REQUEST_WAIT_ENV = "SGLANG_REQUEST_STATE_WAIT_TIMEOUT"
#: The admin token of a cluster's gateway and instances (``--admin-api-key`` wins over it).
ADMIN_TOKEN_ENV = "BANASERVE_ADMIN_TOKEN"
#: SGLang's torch.distributed rendezvous, replacing its ``tcp://HOST:PORT`` one (BanaServe
#: sets a private ``file://`` one; see :mod:`banaserve.server.rendezvous`).
RENDEZVOUS_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"
#: Attention offload of one SGLang instance (JSON, :mod:`banaserve.platform.attention_offload_cpu`):
#: unset, none; the instance's long sequences' decode attention runs on a worker when set.
ATTENTION_OFFLOAD_ENV = "BANASERVE_ATTENTION_OFFLOAD"
