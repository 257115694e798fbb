"""Build hooks: generate the gRPC stubs from protos/ before packaging, and compile the
sandbox zygote's serving loop (a small C extension, see services/kubestar/sandbox/_forkserver.c).

The generated modules (protos/kubestar/v1/*_pb2*.py[i]) are build outputs, never
edited by hand and not committed. `pip install .` and `pip install -e .` both run this.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PROTO_ROOT = Path(__file__).parent / "protos"


def generate_protos() -> None:
    from grpc_tools import protoc  # build-time dependency (pyproject build-system.requires)

    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in sorted(PROTO_ROOT.rglob("*.proto")):
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={PROTO_ROOT}",
            f"--pyi_out={PROTO_ROOT}",
            f"--grpc_python_out={PROTO_ROOT}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {proto}")


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


FORKSERVER = Extension(
    "kubestar.sandbox._forkserver",
    sources=["services/kubestar/sandbox/_forkserver.c"],
    extra_compile_args=["-std=gnu11", "-Wall", "-Wextra"],
)

setup(cmdclass={"build_py": BuildPyWithProtos}, ext_modules=[FORKSERVER])
