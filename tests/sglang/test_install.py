"""The SGLang venv installer (tests/sglang_cpu/install.py): what it installs from a release's
wheel metadata, and a build that cannot be done says why and which package."""

from __future__ import annotations

import sys
import zipfile

import pytest

from tests.sglang.conftest import SLICE
from tests.sglang_cpu.install import SGLangVenvError, _pip, requirements, venv_python

pytestmark = getattr(pytest.mark, SLICE)

METADATA = """Metadata-Version: 2.1
Name: sglang
Version: 0.5.99
Requires-Dist: aiohttp
Requires-Dist: torch==2.13.0
Requires-Dist: torchvision
Requires-Dist: torchaudio==2.11.0
Requires-Dist: sglang-kernel==0.4.10
Requires-Dist: flashinfer_python[cu13]==0.7.2
Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0
Requires-Dist: cuda-tile==1.6.0rc5
Requires-Dist: transformers==5.19.0
Requires-Dist: decord2; sys_platform == "linux" and platform_machine == "aarch64"
Requires-Dist: compressed-tensors[accelerate]
Requires-Dist: datasets
Requires-Dist: pytest; extra == "test"
"""


def test_requirements_leave_out_cuda_kernels_and_pin_the_cpu_torch(tmp_path):
    wheel = tmp_path / "sglang-0.5.99-cp311-cp311-manylinux_2_34_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang-0.5.99.dist-info/METADATA", METADATA)
    reqs = requirements(wheel)
    assert reqs[:2] == ["aiohttp", "torch===2.13.0"]  # the registry's build exactly (torchvision needs it)
    assert "torchvision==0.28.*" in reqs and "transformers==5.19.0" in reqs and "compressed-tensors" in reqs
    for cuda in ("sglang-kernel", "flashinfer", "nvidia-cutlass", "cuda-tile", "torchaudio", "decord2", "pytest"):
        assert not any(r.startswith(cuda) for r in reqs), (cuda, reqs)
    assert {"IPython", "dill", "timm", "soundfile"} <= set(reqs) and reqs.count("datasets") == 1


def test_a_package_pip_cannot_install_is_named():
    with pytest.raises(SGLangVenvError, match="asyncrl-no-such-package-0000") as failed:
        _pip(sys.executable, "install", "--dry-run", "--no-deps", "asyncrl-no-such-package-0000==1.0", step="a test install")
    assert "a test install failed" in str(failed.value)


def test_a_release_that_is_not_one_is_refused_before_anything_runs():
    with pytest.raises(SGLangVenvError, match="not an SGLang release"):
        venv_python("0.5.23; rm -rf /")
