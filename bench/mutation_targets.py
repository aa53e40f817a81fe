"""
Which unit test modules pin each core module, for ``python -m bench.mutation``.

The table changes whenever a core module or its tests move, and nothing else in the
mutation tool does; so it lives alone, where such an edit touches nothing else.
"""

from __future__ import annotations


def _unit(*names: str) -> tuple[str, ...]:
    return tuple(f"tests.unit.{name}" for name in names)


#: Each core module (its path under txlb/, without .py) and the unit test modules that
#: should catch its mutants (in-memory only: fast, deterministic; the integration suites
#: would make each mutant cost minutes).
MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "_proxy/resource": _unit("test_proxy", "test_failover", "test_regressions",
                             "test_budgets", "test_classes", "test_scheduling",
                             "test_routing_request", "test_mutants", "test_mutants_resource"),
    "_proxy/exchange": _unit("test_proxy", "test_proxy_wire", "test_failover",
                             "test_regressions", "test_upstream", "test_failures",
                             "test_budgets", "test_hung", "test_repeats", "test_outcome",
                             "test_classes", "test_scheduling", "test_kvcache",
                             "test_prompt_tokens", "test_mutants", "test_mutants_exchange"),
    "_proxy/failures": _unit("test_failures", "test_proxy", "test_failover",
                             "test_regressions", "test_mutants", "test_mutants_failures"),
    "_proxy/client_end": _unit("test_proxy", "test_proxy_wire", "test_failover",
                               "test_regressions", "test_mutants_exchange"),
    "_proxy/head": _unit("test_head", "test_proxy", "test_properties", "test_mutants"),
    "_upstream/client": _unit("test_upstream", "test_regressions", "test_mutants",
                              "test_mutants_upstream"),
    "_upstream/connection": _unit("test_upstream", "test_regressions", "test_mutants",
                                  "test_mutants_upstream"),
    "_upstream/heads": _unit("test_upstream", "test_regressions", "test_mutants",
                             "test_mutants_upstream", "test_proxy"),
    "_upstream/resend": _unit("test_upstream", "test_failures", "test_mutants_upstream"),
    "_cluster/backend": _unit("test_scheduling", "test_failover", "test_regressions",
                              "test_admin", "test_health", "test_mutants", "test_mutants_pool"),
    "_cluster/pool": _unit("test_scheduling", "test_failover", "test_regressions",
                           "test_admin", "test_health", "test_reload", "test_reload_workers",
                           "test_store", "test_shared_state", "test_shared_slots", "test_dns",
                           "test_hung", "test_models", "test_mutants", "test_mutants_pool"),
    "_cluster/outlier": _unit("test_failover", "test_regressions", "test_mutants"),
    "_cluster/models": _unit("test_models", "test_scheduling", "test_health", "test_mutants"),
    "_cluster/health": _unit("test_health", "test_regressions", "test_scheduling",
                             "test_reload", "test_mutants", "test_mutants_health"),
    "_scheduling/router": _unit("test_scheduling", "test_policies", "test_routing_request",
                                "test_failover", "test_policy_failure",
                                "test_policy_prepare", "test_classes", "test_reload",
                                "test_shared_slots", "test_budgets", "test_admin",
                                "test_workers", "test_mutants", "test_mutants_resource",
                                "test_mutants_router"),
    "_scheduling/prefix": _unit("test_cache_aware_prefix", "test_cache_aware",
                                "test_cache_aware_loop", "test_policy_prepare",
                                "test_shared_prefixes", "test_prefix_bench",
                                "test_prefix_scale_out", "test_mutants_cache_aware"),
    "_scheduling/prefix_index": _unit("test_cache_aware", "test_cache_aware_loop",
                                      "test_cache_aware_prefix", "test_shared_prefixes",
                                      "test_kvcache", "test_prefix_bench",
                                      "test_prefix_scale_out", "test_mutants_cache_aware"),
    "_scheduling/policies/cache_aware": _unit("test_cache_aware", "test_cache_aware_loop",
                                              "test_cache_aware_prefix",
                                              "test_policy_prepare", "test_policies",
                                              "test_shared_prefixes", "test_kvcache",
                                              "test_prefix_bench", "test_prefix_scale_out",
                                              "test_policy_registry", "test_mutants_registry",
                                              "test_mutants_cache_aware"),
    **{f"_scheduling/policies/{name}": _unit("test_policies", "test_scheduling",
                                             "test_policy_registry", "test_mutants")
       for name in ("_ties", "least_conn", "round_robin", "weighted_random", "p2c", "peak_ewma",
                    "queue_depth")},
    "_scheduling/policies/registry": _unit("test_policies", "test_scheduling",
                                           "test_policy_registry", "test_mutants",
                                           "test_mutants_registry"),
    "_server/site": _unit("test_failover", "test_regressions", "test_proxy", "test_repeats",
                          "test_admin", "test_mutants", "test_mutants_site",
                          # the lean server's tests hold both servers to the same refusals
                          "test_lean", "test_review_lean")
    + ("tests.integration.test_framing",),
    # the framing rules both servers share (MAX_LINE, ChunkPace, ...)
    "_server/rules": _unit("test_lean", "test_review_lean", "test_mutants_site",
                           "test_regressions", "test_proxy", "test_repeats")
    + ("tests.integration.test_framing",),
    "_records/resultlog": _unit("test_resultlog", "test_regressions", "test_summary",
                                "test_mutants", "test_mutants_resultlog"),
    **{f"_records/{name}": _unit("test_summary", "test_prompt_tokens", "test_properties",
                                 "test_regressions", "test_resultlog", "test_mutants",
                                 "test_mutants_summary")
       for name in ("summary", "record", "capture", "privacy", "apis", "answers/completion",
                    "answers/chat", "answers/responses", "answers/messages",
                    "answers/embeddings")},
    "_json_body": _unit("test_summary", "test_summary_stream", "test_routing_request"),
    "_records/fields": _unit("test_fields", "test_summary", "test_prompt_tokens",
                             "test_properties", "test_resultlog", "test_workers",
                             "test_classes", "test_mutants"),
}
