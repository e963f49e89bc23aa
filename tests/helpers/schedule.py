"""The order the suite runs in: the slowest tests first (`tests/conftest.py` applies it).

`make test` spreads the tests over the cores with pytest-xdist, `--dist worksteal`
(pyproject.toml): each worker takes its share of the collection in order, and one that runs
out takes the second half of the longest queue left. A test cannot be split, so a long
test that starts late makes the run's tail as long as itself (the soak's 50 s, the
benchmark's 56 s); started first, the short tests fill in around them and the workers
end together. A module moves whole, heaviest first (its module fixtures made once).

`SECONDS` holds what the slowest tests took, one row of a parametrized test (measured
in a whole `-n 2` run on a loaded 2-core machine, the soak's and the benchmark's one
directory at a time with `-n 0`: weights for the order, not promises). A test marked
`slow` that is not listed weighs `SLOW`, so a new slow test runs early before anyone
measures it. Modules without either keep pytest's order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW = 10.0  # seconds: a test marked `slow` that `SECONDS` does not list

SECONDS: dict[str, float] = {
    # third-party agent CLIs (each a process that starts in seconds, some retrying)
    "tests/integration/test_agent_clis.py::test_aider_message": 21,
    "tests/integration/test_agent_clis.py::test_aider_and_opencode_print_a_model_refusal": 21,
    "tests/integration/test_agent_clis.py::test_opencode_run": 25,
    "tests/integration/test_agent_clis.py::test_gemini_cli_print": 11,
    "tests/integration/test_agent_clis.py::test_gemini_cli_prints_a_model_refusal": 9,
    "tests/integration/test_agent_clis.py::test_codex_prints_a_model_refusal": 14,
    "tests/integration/test_agent_clis.py::test_claude_code_prints_a_model_refusal": 3,
    # real gateway processes under load, outages, kills and restarts
    "tests/reliability/test_soak.py::test_soak_mixed_load_leaves_no_sockets_and_flat_memory": 52,
    "tests/test_bench_smoke.py::test_quick_benchmark_produces_every_row_and_workload": 56,
    "tests/integration/test_budget_durability.py::"
    "test_a_killed_process_never_leaves_a_call_charged_less_than_it_used": 27,
    "tests/reliability/test_state_volume.py::"
    "test_a_filling_state_volume_is_warned_of_and_never_stops_revocations": 4,
    "tests/reliability/test_memory_burst.py::"
    "test_a_burst_of_intercepted_tunnels_gives_its_memory_back": 66,  # (5,000 tunnels)
    "tests/reliability/test_memory_burst.py::"
    "test_above_limits_memory_new_connections_are_refused_until_it_comes_back": 18,
    "tests/reliability/test_state_outage.py::"
    "test_a_full_state_disk_never_lets_a_revoked_token_through": 26,
    "tests/reliability/test_state_outage.py::"
    "test_redis_killed_never_lets_a_revoked_token_through": 10,
    "tests/reliability/test_audit_trail.py::"
    "test_worker_processes_spill_their_own_lines_and_one_process_takes_them_all": 13,
    "tests/reliability/test_timeouts.py::test_slow_heads_are_cut_and_others_still_served": 5,
    # learn mode with a real agent, then enforcing what it learned (two aider runs)
    "tests/integration/test_learn_agent_cli.py::test_aider_learned_then_enforced": 43,
    # MCP OAuth: the SDK's server, authorization server and client, per engine
    "tests/integration/test_mcp_oauth.py::"
    "test_two_workers_share_the_grant_and_a_restart_keeps_it": 23,
    "tests/integration/test_mcp_oauth.py::test_insufficient_scope_goes_back_to_consent": 12,
    "tests/integration/test_mcp_oauth.py::test_the_token_is_refreshed_before_it_expires": 18,
    "tests/integration/test_mcp_oauth.py::"
    "test_an_agent_lists_and_calls_tools_after_one_consent": 12,
    "tests/integration/test_mcp_oauth.py::"
    "test_a_token_the_server_refuses_is_refreshed_on_the_retry": 12,
    "tests/integration/test_mcp_oauth.py::test_a_revoked_grant_asks_again": 15,
    "tests/integration/test_mcp_oauth.py::"
    "test_consent_and_revocation_in_the_console_with_chromium": 10,
    "tests/integration/test_mcp_oauth.py::"
    "test_the_cli_shows_the_consent_url_lists_and_revokes": 23,
    # several gateway processes (workers, restarts, a second process on one store)
    "tests/integration/test_approvals.py::test_a_grant_takes_effect_on_every_worker_at_once": 32,
    "tests/integration/test_worker_minting.py::"
    "test_a_rotated_refresh_token_is_used_by_every_worker_and_after_a_restart": 26,
    "tests/integration/test_worker_minting.py::"
    "test_one_github_app_token_for_both_workers_and_after_a_restart": 16,
    "tests/services/state/test_state_redis.py::test_two_gateway_processes_share_revocations": 25,
    "tests/integration/test_console_fuzz.py::test_no_console_or_approvals_request_answers_5xx": 6,
    "tests/reliability/test_audit_trail.py::"
    "test_lines_held_at_a_stop_are_written_first_at_the_next_start": 20,
    "tests/integration/test_mcp_policy.py::"
    "test_a_tool_that_changes_its_description_is_flagged_or_pinned": 17,
    # measured again (2026-11-29, a fresh-clone `-n 2` run at load 11 on 2 cores: slower
    # than above, for the order only): tests of 10 s or more that no weight named, so
    # their modules ran in pytest's order, some of them last
    "tests/integration/test_mcp_oauth.py::"
    "test_on_redis_two_workers_share_one_consent_refresh_once_and_revoke": 42,
    "tests/integration/test_mcp_oauth.py::"
    "test_replicas_with_the_key_in_the_secret_store_open_each_others_grants": 29,
    "tests/integration/test_egress_safety.py::test_websocket_credential_relay_and_no_retention": 33,
    "tests/integration/test_budget_adversarial.py::test_sigkill_after_calls_loses_no_usage": 28,
    "tests/integration/test_budget_adversarial.py::test_random_mix_redis": 25,
    "tests/integration/test_budget_adversarial.py::test_random_mix_two_workers": 24,
    "tests/integration/test_budget_adversarial.py::"
    "test_sigkill_after_realtime_responses_loses_no_usage": 16,
    "tests/integration/test_client_matrix.py::test_maven": 22,
    "tests/integration/test_client_matrix.py::test_pip_install": 13,
    "tests/integration/test_client_matrix.py::test_maven_from_an_http_repository": 13,
    "tests/integration/test_credentials.py::test_official_sdks_through_the_gateway": 18,
    "tests/integration/test_credentials.py::test_a_key_shaped_token_from_env": 16,
    "tests/integration/test_dns.py::test_transparent_sandbox_resolves_through_the_gateway": 14,
    "tests/integration/test_dns.py::test_bad_listen_dns_stops_the_gateway": 10,
    "tests/integration/test_log_secrets.py::test_no_secret_in_the_log": 14,
    "tests/integration/test_kubernetes_identity.py::test_every_worker_process_knows_the_pods": 13,
    "tests/integration/test_console_sessions.py::"
    "test_sign_out_on_one_worker_ends_the_session_on_both": 13,
    "tests/integration/test_console_browser.py::test_every_page_meets_wcag_21_aa": 12,
    "tests/integration/test_metering.py::test_sdks_streaming_and_not_are_metered": 12,
    "tests/integration/test_console_log_workers.py::"
    "test_every_workers_lines_in_one_log_and_one_live_stream": 10,
    "tests/engines/test_patches_pins.py::test_only_patches_imports_mitmproxys_proxy_core": 10,
    # measured again (2026-11-29, a `-n 2 --durations=0` run at load 12-16 on 2 cores,
    # halved to the scale above): tests of 10 s or more there that no weight named, run in
    # pytest's order and some of them in the run's last minute
    "tests/core/test_policy_matcher.py::test_decision_cost_does_not_grow_with_rules": 11,
    "tests/test_parity_decisions.py::"
    "test_a_disagreement_across_xdist_workers_fails_the_case": 11,
    "tests/integration/test_service_presets.py::test_maven_central_preset_mvn": 10,
    "tests/integration/test_worker_state.py::test_two_workers_agree_exactly": 7,
    "tests/test_demo.py::test_demo_shows_the_key_swap_and_a_refusal": 7,
    "tests/integration/test_optional_imports.py::"
    "test_mitmproxy_is_loaded_at_the_first_http2_client": 7,
    "tests/integration/test_kubernetes_netns.py::"
    "test_transparent_mode_knows_a_pod_by_its_address": 7,
    "tests/integration/test_worker_processes.py::"
    "test_the_open_connections_gauge_is_exact_after_a_worker_is_killed": 5,
    "tests/integration/test_worker_processes.py::"
    "test_the_supervisor_runs_on_cpythons_allocator_and_the_workers_on_jemalloc": 5,
    "tests/integration/test_worker_processes.py::test_two_workers_share_ports_state_and_metrics": 5,
    "tests/integration/test_startup_output.py::test_banner_never_prints_the_admin_token": 4,
    "tests/integration/test_client_refusals.py::test_python_sdk_refused_connect": 4,
    "tests/test_schedule.py::"
    "test_the_slowest_are_collected_first_and_the_rest_keep_their_order": 6,
    "tests/integration/test_shutdown.py::test_sigterm_lets_in_flight_requests_finish": 5,
    # measured again (2026-11-30, a `-n 2 --durations=0` run at load 4-5 on 2 cores, one
    # row of a parametrized test): tests of 4.5 s or more there that no weight named
    "tests/integration/test_tls_resumption.py::"
    "test_a_two_thread_websocket_client_gets_its_ticket_with_the_upgrade": 8,
    "tests/integration/test_otel_export.py::"
    "test_a_collector_down_is_counted_at_metrics_and_the_export_resumes_when_it_is_back": 7,
    "tests/integration/test_minted_oauth.py::test_a_token_is_refreshed_before_it_expires": 6,
    "tests/integration/test_parity_transparent.py::test_no_secret_in_the_gateway_log": 6,
    "tests/integration/test_client_refusals.py::test_python_sdk_refused_request": 6,
    "tests/integration/test_client_refusals.py::test_pip_refused_request": 5,
    "tests/integration/test_client_matrix.py::test_python_sdks": 6,
    "tests/integration/test_agent_clis.py::test_codex_exec": 6,
    "tests/integration/test_mcp_policy.py::test_the_sdk_client_calls_what_the_rule_allows": 5,
    "tests/integration/test_metering.py::"
    "test_two_gateway_processes_sharing_redis_enforce_one_budget": 5,
    "tests/integration/test_worker_processes.py::"
    "test_the_supervisor_holds_only_the_standard_library": 5,
    "tests/integration/test_worker_processes.py::"
    "test_workers_end_when_their_supervisor_is_killed": 5,
    "tests/integration/test_kubernetes_identity.py::test_a_stale_watch_fails_closed": 4,
    # the parity tables: hundreds of short rows on one gateway a module (its set-up 2-4 s):
    # weighed by the row so each module starts early and whole, not split at the run's end
    "tests/integration/test_parity_transparent.py::test_case_transparent": 0.2,
    "tests/integration/test_parity_pods.py::test_row": 0.13,
    "tests/integration/test_parity.py::test_case": 0.11,
}


def weight(item: pytest.Item) -> float:
    """Seconds `item` is expected to take, for the order (0: a short test)."""
    listed = SECONDS.get(item.nodeid.split("[", 1)[0])
    if listed is not None:
        return listed
    return SLOW if item.get_closest_marker("slow") is not None else 0.0


def slowest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: the modules that weigh most first (the sum of their
    tests' weights), each module's tests together and in their order, so its module
    fixtures are made once (a module split up makes them again: the agent CLIs' took
    20-30 s a time); modules that weigh nothing as collected (a stable sort)."""
    modules: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        modules[module] = modules.get(module, 0.0) + weight(item)
    items.sort(key=lambda item: modules[item.nodeid.split("::", 1)[0]], reverse=True)


def stale(root: Path) -> list[str]:
    """`SECONDS` entries whose file or test function no longer exists."""
    gone = []
    for test in SECONDS:
        path, _, name = test.partition("::")
        source = root / path
        if not source.is_file() or f"def {name}(" not in source.read_text():
            gone.append(test)
    return gone
