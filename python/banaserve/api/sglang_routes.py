"""Every HTTP route SGLang 0.5.23's server has, each classified, so none reaches it unchecked.

The instance guard (:mod:`banaserve.server.request_guard`) checks a request to any path of
:data:`GENERATING`, whatever its method, before SGLang sees it: by the shape of its body (a
native ``/generate`` body, an OpenAI completions or chat body, a Vertex AI body), or, for the
routes whose bodies have other shapes, the JSON bounds alone; the token ids of every route are
checked again where SGLang tokenises (:mod:`banaserve.server.token_id_check`).
:data:`ADMIN` routes change the server's state; :data:`READ_ONLY` ones only describe it.

``test/e2e/test_sglang_route_table.py`` lists the routes of SGLang's app and fails on any path
that is in none of these tables, so a route added by a new SGLang cannot slip by.
"""

from __future__ import annotations

from banaserve.api.request_validation import CHAT, COMPLETIONS, GENERATE

#: Body kinds beyond the three of :mod:`banaserve.api.request_validation`.
VERTEX = "vertex"  # {"instances": [native inputs], "parameters": {native fields}}
JSON_ONLY = "json"  # a JSON body of another shape: size, depth, content type, model name
FORM = "form"  # multipart form data (audio uploads): size only

#: Routes whose request reaches the model, by the kind of body they take.
GENERATING: dict[str, str] = {
    GENERATE: GENERATE,
    "/encode": GENERATE,
    "/classify": GENERATE,
    "/vertex_generate": VERTEX,
    COMPLETIONS: COMPLETIONS,
    CHAT: CHAT,
    "/invocations": CHAT,  # SageMaker's chat completions
    **{
        path: JSON_ONLY
        for path in (
            "/v1/embeddings",
            "/v1/classify",
            "/v1/score",
            "/v1/decisions",
            "/v1/responses",
            "/v1/rerank",
            "/api/chat",
            "/api/generate",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/systemone",
            "/tokenize",
            "/v1/tokenize",
            "/detokenize",
            "/v1/detokenize",
            "/parse_function_call",
            "/separate_reasoning",
        )
    },  # fmt: skip
    "/v1/audio/transcriptions": FORM,
}

#: Routes that change the server's state (caches, weights, profiling, sessions, requests).
ADMIN = frozenset({
    "/scale_elastic_ep", "/set_internal_state", "/flush_cache", "/add_external_corpus",
    "/remove_external_corpus", "/hicache/storage-backend/clear", "/hicache/storage-backend",
    "/start_profile", "/stop_profile", "/set_trace_level", "/freeze_gc",
    "/start_expert_distribution_record", "/stop_expert_distribution_record",
    "/dump_expert_distribution_record", "/update_weights_from_disk",
    "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
    "/init_weights_update_group", "/destroy_weights_update_group",
    "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_distributed", "/update_weights_from_ipc", "/update_weight_version",
    "/get_weights_by_name", "/release_memory_occupation", "/resume_memory_occupation",
    "/weights_checker", "/slow_down", "/pd_role_switch", "/load_lora_adapter",
    "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/open_session",
    "/close_session", "/configure_logging", "/abort_request", "/pause_generation",
    "/continue_generation", "/v1/responses/{response_id}/cancel", "/v1/realtime",
})  # fmt: skip

#: Routes that only describe the server or the model.
READ_ONLY = frozenset({
    "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/v1/loads",
    "/is_scaling_elastic_ep", "/ready", "/health_generate", "/health", "/get_model_info",
    "/model_info", "/get_server_info", "/server_info", "/list_external_corpora",
    "/get_hicache_l3_cache_layout", "/get_remote_instance_transfer_engine_info",
    "/remote_instance_transfer_engine_info", "/v1/models", "/v1/models/{model:path}",
    "/v1/responses/{response_id}", "/", "/api/tags", "/api/show", "/ping",
})  # fmt: skip

#: Methods that carry no body to check.
BODILESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def vertex_as_native(body: dict) -> dict:
    """A Vertex AI body as the native ``/generate`` body SGLang makes of it: the first input
    field the first instance has, gathered over the instances, and the parameters."""
    instances = body.get("instances")
    parameters = body.get("parameters")
    native = dict(parameters) if isinstance(parameters, dict) else {}
    if isinstance(instances, list) and instances and isinstance(instances[0], dict):
        for key in ("text", "input_ids", "input_embeds"):
            if instances[0].get(key):
                native[key] = [i.get(key) if isinstance(i, dict) else None for i in instances]
                break
    return native
