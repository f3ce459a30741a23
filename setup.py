"""Builds dcredit_opt's C++ extension dcredit_opt._C (metadata: pyproject.toml).

The extension is compiled against the torch already in the environment, so
build without isolation: ``pip install --no-build-isolation .`` (``make
install`` does ``pip install --no-build-isolation --no-deps -e .``). An
isolated build sees no torch, and fetching one for it would compile against
a torch other than the one the extension runs with; so torch is not a build
requirement, and a build without it stops at once with a message saying
what to run. The torch version is recorded at build time and checked at
import (``_ext.py``).

When the installed torch has CUDA and a CUDA toolkit is found (``CUDA_HOME``,
or torch's guess from ``nvcc`` on the PATH), the extension is a ``CUDAExtension`` that also
compiles ``CUDA_ONLY`` with ``DCREDIT_WITH_CUDA`` defined (see
``csrc/torch/cuda_sync.h``); otherwise it is a ``CppExtension`` with no CUDA
code at all.
"""

import os
import sys
from pathlib import Path

# The torch the test suite runs on (Makefile's TORCH_VERSION), and the tested
# range that pyproject.toml declares (tests/packaging checks they agree).
TESTED_TORCH = "2.13.0"
TORCH_RANGE = ">=2.13,<2.15"

try:
    import torch
except ImportError:
    sys.exit(
        "error: dcredit-opt's C++ extension is compiled against the torch it will run with, so torch must be "
        "importable while it is built, and here it is not. Either torch is not installed yet, or (the usual "
        "case) pip is building in an isolated environment, as it does by default, which holds only the build "
        "tools: torch is deliberately not a build requirement, because a torch fetched into that environment "
        "would differ from yours (often a multi-GB CUDA download) and the import would refuse the extension. "
        f"Install torch (any torch{TORCH_RANGE}) if it is not installed, then build without isolation:\n"
        f"    pip install torch=={TESTED_TORCH}\n"
        "    pip install --no-build-isolation .\n"
        "(or pip install --no-build-isolation -e . for an editable install)"
    )

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent

# Every source listed here must also be in the sdist (MANIFEST.in).
CORE = ["csrc/core/scheduler.cc", "csrc/core/backends.cc"]
TORCH = ["csrc/torch/torch_backend.cc", "csrc/torch/gradient_path.cc", "csrc/torch/side_sums.cc",
         "csrc/torch/addresses.cc", "csrc/torch/bindings.cc"]
CUDA_ONLY = ["csrc/torch/cuda_sync.cc"]
# No -std: torch's build adds the standard its headers need (C++20 since
# torch 2.14, whose headers refuse C++17). A release build: -g0 comes after
# any -g from Python's own CFLAGS and wins, and the linker strips what is
# left (with debug info the extension is about 18 MB; the sanitizer and
# debugger builds of the core are tests/cpp/run.sh's).
CXX_FLAGS = ["-O2", "-Wall", "-g0"]
LINK_FLAGS = ["-s"]
if os.environ.get("DCREDIT_SANITIZE") == "address":
    # tests/cpp/ext_sanitize.sh alone (make sanitize-ext): the whole extension with AddressSanitizer + UBSan,
    # into a build folder of its own; never a build users install.
    CXX_FLAGS = ["-O1", "-g", "-Wall", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                 "-fno-sanitize-recover=all"]
    LINK_FLAGS = ["-fsanitize=address,undefined"]


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
                             extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O2"]}, extra_link_args=LINK_FLAGS)
    return CppExtension(name="dcredit_opt._C", sources=CORE + TORCH, extra_compile_args=CXX_FLAGS,
                        extra_link_args=LINK_FLAGS)


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
    ext_modules=[extension(WITH_CUDA)],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)},
)
