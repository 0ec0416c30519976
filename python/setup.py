"""The package with its library: `pip install ./python` (or `pip wheel ./python`) compiles
libfsdp_fusion from the checkout's crate with cargo, through setuptools-rust, and installs it
inside the package as `fsdp_fusion/libfsdp_fusion.abi3.so`. The library's C ABI does not depend
on the Python version, so one wheel serves every CPython the package supports.

The crate's build script compiles the CUDA kernels in when it finds nvcc (`$NVCC`, else
`$CUDA_HOME/bin/nvcc`, else `nvcc` on `PATH`); without one the library still builds, its CPU
engines work, and a CUDA engine raises `UnavailableError`, saying the kernels are not in this
build."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools_rust import Binding, RustExtension

CRATE = Path("..") / "Cargo.toml"


def nvcc() -> str | None:
    """The nvcc the crate's build script will use, found the same way."""
    home = os.environ.get("CUDA_HOME")
    for candidate in (os.environ.get("NVCC"), home and str(Path(home) / "bin" / "nvcc")):
        if candidate and Path(candidate).is_file():
            return candidate
    return shutil.which("nvcc")


if not (Path(__file__).resolve().parent / CRATE).is_file():
    sys.exit("fsdp-fusion builds from a checkout: the crate's Cargo.toml is not beside the "
             "package's directory (build with `pip install ./python` or `pip wheel ./python`, "
             "not from an sdist)")
if nvcc() is None:
    print("fsdp-fusion: nvcc not found ($NVCC, $CUDA_HOME/bin/nvcc, PATH): the library is built "
          "without its CUDA kernels; CPU engines work, CUDA engines raise UnavailableError",
          file=sys.stderr)

setup(
    rust_extensions=[
        RustExtension("fsdp_fusion.libfsdp_fusion", path=str(CRATE), binding=Binding.NoBinding),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    zip_safe=False,
)
