"""Stages on a CUDA GPU: placement, TensorPipe device maps between GPU workers, the CPU driver's
boundaries, and everything that touches CUDA (checkpoint RNG, balancing, batch norm, memory reports).

Each scenario (``tests/gpu/scenarios.py``) runs in a fresh interpreter with its own local workers, as
the shared CPU workers of the other tests have no device maps. Without a GPU these tests are skipped;
they run wherever ``torch.cuda.is_available()`` (see README, Status). ``RREFPIPE_TEST_GPU=cpu`` runs
them on the CPU instead, a dry run of the scenarios themselves (the refusal of CUDA inputs and of
missing device maps then has nothing to refuse).
"""
import pytest

from tests.conftest import parameter_drifts
from tests.gpu import runner
from tests.gpu.scenarios import GPU

pytestmark = runner.MARKS


def scenario(call: str) -> None:
    runner.scenario("tests.gpu.scenarios", call)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpu_stages_match_the_plain_model(checkpoint):
    scenario(f"transparency({checkpoint!r})")


def test_skips_between_gpu_workers():
    scenario("skips_between_gpu_workers()")


@pytest.mark.parametrize("devices", [["cpu", GPU], [GPU, "cpu"]])
def test_cpu_and_gpu_stages_in_one_pipe(devices):
    scenario(f"mixed_devices({devices!r})")


def test_stages_follow_the_layers_devices():
    scenario("stages_follow_the_layers_devices()")


def test_training_with_the_distributed_optimizer():
    scenario("training_with_distributed_optimizer()")


def test_optimizer_state_and_learning_rate_schedule_on_gpu_stages():
    scenario("optimizer_state_and_schedule()")


def test_optimizer_steps_are_ordered_after_backward_and_before_the_next_forward():
    scenario("optimizer_steps_are_ordered()")


def test_autocast_and_gradient_clipping_on_gpu_stages():
    scenario("autocast_and_clipping()")


def test_float16_loss_scaling_on_gpu_stages():
    scenario("float16_loss_scaling()")


def test_automatic_balance_on_the_gpu():
    scenario("automatic_balance()")


def test_world_size_one_runs_gpu_stages_in_process():
    scenario("world_size_one()")


def test_deferred_batch_norm_on_the_gpu():
    scenario("deferred_batch_norm()")


def test_remote_output_and_state_dict_round_trip():
    scenario("remote_output_and_state_round_trip()")


def test_parameters_the_loss_does_not_reach_get_no_gradient_on_gpu_stages():
    scenario("unreached_parameters()")


def test_gpu_input_is_refused_with_a_clear_error():
    scenario("gpu_input_is_refused()")


def test_workers_without_device_maps_refuse_gpu_tensors_clearly():
    scenario("missing_device_map()")


def test_memory_reports_on_gpu_stages():
    scenario("memory_on_gpu_stages()")


def test_host_copies_do_not_wait_for_the_gpu():
    scenario("host_copies_do_not_wait_for_the_gpu()")


def test_stage_memory_is_steady():
    scenario("stage_memory_is_steady()")


def test_torchrun_job_with_gpu_stage_workers():
    """``torchrun`` on one host, stage workers' device maps from ``torchrun_group(devices=...)``."""
    code, out, err = runner.torchrun_job(4, "-m", "tests.gpu.scenarios")
    assert code == 0 and "driver ok" in out, out + err


@pytest.mark.skipif(runner.DRY_RUN, reason="the example's --cuda asks for a real GPU (no dry run on the CPU)")
def test_data_parallel_replicas_on_gpu_stages():
    """``examples/data_parallel.py --cuda``: 2 replicas of 2 GPU stages (6 processes; on one GPU every
    stage shares it, and the replicas average their CUDA gradients over gloo), equal to plain PyTorch."""
    code, out, err = runner.torchrun_job(6, "examples/data_parallel.py", "--replicas", "2", "--steps", "3", "--cuda")
    assert code == 0, out + err
    drifts = parameter_drifts(out)
    assert len(drifts) == 2 and max(drifts) < 1e-4, out
    assert "on cuda:" in out, out
