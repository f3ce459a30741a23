"""Builds dcredit_opt and its C++ extension dcredit_opt._C.

Install with ``pip install --no-build-isolation -e .`` so that the extension
is compiled against the torch already in the environment (an isolated build
would fetch another torch). The torch version is recorded at build time and
checked at import.

When the installed torch has CUDA and a CUDA toolkit is found (``CUDA_HOME``,
or torch's guess from ``nvcc`` on the PATH), the extension is a ``CUDAExtension`` that also
compiles ``CUDA_ONLY`` with ``DCREDIT_WITH_CUDA`` defined (see
``csrc/torch/cuda_sync.h``); otherwise it is a ``CppExtension`` with no CUDA
code at all.
"""

from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent

CORE = ["csrc/core/scheduler.cc", "csrc/core/backends.cc"]
TORCH = ["csrc/torch/torch_backend.cc", "csrc/torch/bindings.cc"]
CUDA_ONLY = ["csrc/torch/cuda_sync.cc"]
# No -std: torch's build adds the standard its headers need (C++20 since
# torch 2.14, whose headers refuse C++17).
CXX_FLAGS = ["-O2", "-Wall"]


def with_cuda() -> bool:
    """Build the CUDA pieces: the installed torch has CUDA and a toolkit is installed."""
    if torch.version.cuda is None:
        return False
    # torch guesses CUDA_HOME from the first nvcc on the PATH, which may be a
    # wrapper script outside the toolkit: check for the headers we include.
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").is_file():
        print(f"dcredit-opt: torch has CUDA {torch.version.cuda} but no CUDA toolkit was found at "
              f"CUDA_HOME={CUDA_HOME} (set CUDA_HOME): building without CUDA, so parameters on a GPU will be "
              "refused")
        return False
    return True


def extension(cuda: bool):
    if cuda:
        # No device code (no .cu): the CUDA pieces are runtime API calls, so
        # the host compiler builds them against the toolkit's headers.
        return CUDAExtension(name="dcredit_opt._C", sources=CORE + TORCH + CUDA_ONLY,
                             define_macros=[("DCREDIT_WITH_CUDA", "1")],
                             extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O2"]})
    return CppExtension(name="dcredit_opt._C", sources=CORE + TORCH, extra_compile_args=CXX_FLAGS)


def write_build_info(cuda: bool) -> None:
    (ROOT / "dcredit_opt" / "_build_info.py").write_text(
        '"""Written by setup.py: the torch this extension was compiled against."""\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"WITH_CUDA = {cuda!r}\n"
        f"CUDA_VERSION = {torch.version.cuda if cuda else None!r}\n"
    )


WITH_CUDA = with_cuda()
write_build_info(WITH_CUDA)

setup(
    name="dcredit-opt",
    version="0.1.0",
    description="A drop-in distributed optimizer for PyTorch with D-Credit gradient scheduling",
    packages=find_packages(include=["dcredit_opt", "dcredit_opt.*"]),
    python_requires=">=3.10",
    install_requires=["numpy"],
    ext_modules=[extension(WITH_CUDA)],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)},
    entry_points={"console_scripts": ["dcredit-opt=dcredit_opt.cli:main"]},
    zip_safe=False,
)
