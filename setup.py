"""Builds dcredit_opt and its C++ extension dcredit_opt._C.

Install with ``pip install --no-build-isolation -e .`` so that the extension
is compiled against the torch already in the environment (an isolated build
would fetch another torch). The torch version is recorded at build time and
checked at import.
"""

import os
from pathlib import Path

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent

CORE = ["csrc/core/scheduler.cc", "csrc/core/backends.cc"]
TORCH = ["csrc/torch/torch_backend.cc", "csrc/torch/bindings.cc"]


def write_build_info() -> None:
    (ROOT / "dcredit_opt" / "_build_info.py").write_text(
        '"""Written by setup.py: the torch this extension was compiled against."""\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
    )


write_build_info()

setup(
    name="dcredit-opt",
    version="0.1.0",
    description="A drop-in distributed optimizer for PyTorch with D-Credit gradient scheduling",
    packages=find_packages(include=["dcredit_opt", "dcredit_opt.*"]),
    python_requires=">=3.10",
    install_requires=["numpy"],
    ext_modules=[
        CppExtension(
            name="dcredit_opt._C",
            sources=CORE + TORCH,
            extra_compile_args=["-O2", "-std=c++17", "-Wall"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)},
    entry_points={"console_scripts": ["dcredit-opt=dcredit_opt.cli:main"]},
    zip_safe=False,
)
