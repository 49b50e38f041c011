"""asyncrl.models.cuda_attention: a CUDA process turns the cuDNN SDPA backend off, a CPU one leaves it."""

import pytest
import torch

from asyncrl.models.cuda_attention import avoid_cudnn_attention


@pytest.fixture
def cudnn_sdp_restored():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cuda_device_disables_the_cudnn_backend(cudnn_sdp_restored):
    assert avoid_cudnn_attention(torch.device("cuda", 0)) is True
    assert torch.backends.cuda.cudnn_sdp_enabled() is False
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()


def test_cpu_device_changes_nothing(cudnn_sdp_restored):
    assert avoid_cudnn_attention(torch.device("cpu")) is False
    assert torch.backends.cuda.cudnn_sdp_enabled() is True
