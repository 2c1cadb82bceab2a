"""A disaggregated BanaServe cluster from one command: a KV store, prefill and decode SGLang
instances, and a gateway that speaks SGLang's HTTP API and routes between them."""
