"""Global KV Cache Store: content-addressed KV pages shared by every instance."""

#: Where servers, clients and the launcher read the store's shared token from.
TOKEN_ENV = "BANASERVE_KV_STORE_TOKEN"
