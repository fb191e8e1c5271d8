"""Test set-up: 8 fake CPU devices (before JAX initialises) and float32 matmuls at full precision."""

import os
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `smelt train` processes the tests start switch the XLA cache on: one temporary folder per test run,
# never the repository's data_cache/xla (the trainer itself sets no global JAX configuration).
os.environ.setdefault("SMELT_XLA_CACHE", tempfile.mkdtemp(prefix="smelt-xla-tests-"))

import experiments  # noqa: E402,F401 — fills the library's suite registry (smelt_jax.design.suites), as the CLI does

from smelt_jax.train.compile_cache import enable_compilation_cache  # noqa: E402

# In-process trainers reuse the compiles of earlier tests through the same per-run folder.
enable_compilation_cache(os.environ["SMELT_XLA_CACHE"])


# The integration tier by cost: tests that took >= 12 s each in the fast tier on a loaded 2-core CPU
# (`pytest --durations=0 -n 2`, 2026-12-02; ~40% more than on an idle machine; seven more from a
# fresh-clone run on 2026-12-03 at 9 min 28 s of pytest: `--durations=40`) run in
# `make test-integration`, which CI runs after `make test`, so nothing is lost and `make test` stays
# under 10 minutes. A parametrized family keeps its cheapest member in the fast tier. An entry that names
# no test of a collected file is an error (a renamed test must be renamed here too).
SLOW_IN_THE_FAST_TIER = (
    "tests/test_analysis_evaluate.py::test_analyses_end_to_end_on_the_trained_looped_model",  # 37 s
    "tests/test_analysis_evaluate.py::test_cli_eval_json_and_analyze_csvs",  # 11 s + 40 s of its trained-run fixture
    "tests/test_analysis_evaluate.py::test_estimate_counts_the_passes_the_evaluation_runs",  # 15 s
    "tests/test_analysis_evaluate.py::test_eval_of_a_trained_run_matches_the_trainer_and_is_consistent",  # 81 s
    "tests/test_analysis_evaluate.py::test_model_score_fn_equals_a_manual_log_prob_computation",  # 52 s
    "tests/test_attention_splash.py::test_splash_matches_the_reference_forward_and_gradients",  # 31 s
    "tests/test_attention_splash.py::test_splash_under_a_mesh_splits_batch_and_heads",  # 20 s
    "tests/test_attention_splash.py::test_the_attention_layer_takes_splash_when_asked",  # 18 s
    "tests/test_bf16.py::test_bf16_matmuls_with_float32_statistics_loss_and_gradients",  # 24 s
    "tests/test_data_prepare.py::test_gcs_store_matches_local_and_batches_agree",  # 14 s
    "tests/test_demo_report.py::test_degenerate_table_is_reported_not_raised",  # 18 s
    "tests/test_experts.py::test_backend_matches_dense_forward_and_gradients[megablox-bf16]",  # 15 s
    "tests/test_experts.py::test_backend_matches_dense_forward_and_gradients[megablox-f32]",  # 13 s
    "tests/test_experts.py::test_backend_matches_dense_forward_and_gradients[pallas-bf16]",  # 14 s
    "tests/test_experts.py::test_backend_matches_dense_forward_and_gradients[pallas-f32]",  # 13 s
    "tests/test_experts.py::test_tiled_backend_chunk_edges_match_float64_and_dense[around_every_chunk]",  # 14 s
    "tests/test_kernels_pallas.py::test_gmm_gradients_match_ragged_dot[float32]",  # 17 s
    "tests/test_loss.py::test_chunked_loss_and_gradients_match_the_unfused_reference[8-einsum]",  # 12 s
    "tests/test_model_cost.py::test_compiled_program_does_not_grow_with_depth",  # 31 s
    "tests/test_model_decode.py::test_greedy_decoding_equals_argmax_of_a_full_forward",  # 14 s
    "tests/test_model_decoder.py::test_scanned_and_unrolled_layers_give_the_same_numbers[full]",  # 25 s
    "tests/test_model_decode.py::test_prefill_and_steps_reproduce_the_full_forward[scan]",  # 16 s
    "tests/test_model_decode.py::test_prefill_and_steps_reproduce_the_full_forward[unrolled]",  # 16 s
    "tests/test_model_decoder.py::test_loop_repeats_one_equals_the_unlooped_network",  # 47 s
    "tests/test_model_decoder.py::test_looped_model_equals_manual_unrolling_with_shared_weights",  # 20 s
    "tests/test_model_decoder.py::test_remat_does_not_change_gradients_and_the_loop_weights_learn",  # 56 s
    "tests/test_moe_buffers.py::test_sized_exchange_equals_the_dropless_reference[layout0-128-8-2-random-0.5-None-padded]",  # 13 s
    "tests/test_moe_buffers.py::test_sized_exchange_equals_the_dropless_reference[layout4-96-8-2-hot-0.3-1.0-padded]",  # 15 s
    "tests/test_demo_report.py::test_table_that_cannot_be_fitted_is_reported",  # 109 s sharing one core
    "tests/test_reliability_sweep.py::test_damaged_final_checkpoint_is_not_done_and_the_sweep_retrains_it",  # 82 s
    "tests/test_fit_isa.py::test_smoke_and_chinchilla_fits_are_the_same_bytes_at_avx2_and_at_the_default_isa",  # 62 s
    "tests/test_model_decoder.py::test_scanned_and_unrolled_layers_give_the_same_numbers[none]",  # 56 s
    "tests/test_model_decoder.py::test_the_loop_visits_do_not_stack_saved_activations_twice",  # 39 s
    # the notebooks' module fixture executes them (120 s under a second job's load, issue 53 item 7)
    "tests/test_notebooks.py::test_executed_notebooks_show_their_figures_inline[training_curves]",
    "tests/test_notebooks.py::test_executed_notebooks_show_their_figures_inline[scaling_fits]",
    "tests/test_notebooks.py::test_executed_notebooks_show_their_figures_inline[results_micro]",
    "tests/test_notebooks.py::test_every_notebook_executes_on_a_fixture",  # 54 s
    "tests/test_notebooks.py::test_fixture_environment_and_a_failing_notebook_is_reported",  # 47 s
    "tests/test_parallel_expert.py::test_expert_parallel_moe_matches_the_unsharded_layer[layout1-3-5-random-None-padded]",  # 55 s
    "tests/test_parallel_expert.py::test_expert_parallel_moe_matches_the_unsharded_layer[layout2-2-7-empty_expert-None-padded]",  # 45 s
    "tests/test_parallel_expert.py::test_expert_parallel_moe_matches_the_unsharded_layer[layout3-2-8-one_expert-None-padded]",  # 42 s
    "tests/test_parallel_expert.py::test_expert_parallel_moe_matches_the_unsharded_layer[layout4-4-8-random-1.0-padded]",  # 47 s
    "tests/test_parallel_expert.py::test_expert_parallel_moe_matches_the_unsharded_layer[layout5-3-5-random-None-ragged]",  # 13 s
    "tests/test_parallel_expert.py::test_expert_parallel_moe_matches_the_unsharded_layer[layout6-3-5-random-None-auto]",  # 34 s
    "tests/test_parallel_expert.py::test_experts_must_split_over_the_expert_axis",  # 16 s
    "tests/test_reliability_cli.py::test_read_only_runs_root_is_one_line_and_exit_2[command0]",  # 26 s
    "tests/test_reliability_cli.py::test_smelt_train_on_a_full_tmpfs_stops_at_the_failed_save_with_one_line",  # 73 s
    "tests/test_reliability_trainer.py::test_damaged_fork_checkpoint_is_not_ready_and_the_stable_job_retrains_it",  # 15 s
    "tests/test_reliability_trainer.py::test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes[no_commit_metadata]",  # 48 s
    "tests/test_reliability_trainer.py::test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes[no_metadata_item]",  # 23 s
    "tests/test_reliability_trainer.py::test_damaged_newest_checkpoint_is_moved_aside_and_the_run_finishes[truncated]",  # 20 s + 35 s setup
    "tests/test_reliability_trainer.py::test_failed_async_save_stops_training_at_once",  # 27 s
    "tests/test_reliability_trainer.py::test_metrics_tokens_are_cumulative_and_a_torn_line_is_skipped",  # 20 s
    "tests/test_scaling_cli.py::test_fit_bootstrap_gain_and_tables",  # 30 s
    "tests/test_scaling_cli.py::test_fits_all_is_deterministic",  # 38 s
    "tests/test_scaling_endpoints.py::test_suite_folder_is_a_deterministic_function_of_results_csv",  # 62 s
    "tests/test_scaling_fit.py::test_batched_lbfgs_matches_scipy_per_start",  # 12 s
    "tests/test_scaling_fit.py::test_cell_bootstrap_covers_truth",  # 13 s
    "tests/test_scaling_fit.py::test_chinchilla_bootstrap_se_first_400_draws",  # 21 s
    "tests/test_scaling_preregistered.py::test_a_normal_law_is_recovered_and_counts",  # 12 s
    "tests/test_scaling_preregistered.py::test_no_asymptote_fails_on_E_and_noise_fails_on_rmse",  # 24 s
    "tests/test_scaling_preregistered.py::test_partial_data_gives_a_verdict_that_does_not_count_and_no_ce_gain",  # 33 s
    "tests/test_scaling_preregistered.py::test_the_suite_pipeline_runs_the_preregistered_test_and_keeps_the_repeat_out_of_the_fits",  # 34 s
    "tests/test_sharding_mesh.py::test_sharded_train_step_matches_one_device[d2f2e2]",  # 51 s
    "tests/test_sharding_mesh.py::test_sharded_train_step_matches_one_device[f4e2]",  # 58 s + 32 s setup
    "tests/test_sweep_local.py::test_run_suite_locally_raises_naming_the_failed_job",  # 17 s
    "tests/test_sweep_render.py::test_every_smelt16_manifest_validates",  # 24 s
    "tests/test_tensorboard.py::test_resumed_phase_event_files_match_metrics_jsonl",  # 27 s
    "tests/test_tensorboard.py::test_smelt_train_profile_writes_a_trace_for_a_three_step_run",  # 22 s
    "tests/test_trainer.py::test_branch_needs_the_fork_checkpoint_then_writes_an_endpoint",  # 26 s
    "tests/test_trainer.py::test_interrupted_and_resumed_is_bit_identical",  # 33 s
    "tests/test_trainer.py::test_same_seed_same_losses_and_loss_decreases",  # 23 s
    "tests/test_trainer.py::test_truncated_checkpoint_is_skipped_on_resume",  # 21 s
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    by_id = {item.nodeid: item for item in items}
    files = {item.nodeid.split("::")[0] for item in items}
    stale = [name for name in SLOW_IN_THE_FAST_TIER if name.split("::")[0] in files and name not in by_id]
    if stale:
        raise pytest.UsageError("tests/conftest.py SLOW_IN_THE_FAST_TIER names tests that do not exist: "
                                + ", ".join(stale))
    for name in SLOW_IN_THE_FAST_TIER:
        if name in by_id:
            by_id[name].add_marker(pytest.mark.integration)
