"""LibTorch for the model processes: Debian's CPU build (libtorch-dev) by default, or a LibTorch
named by $BERTSHARD_LIBTORCH -- the `torch/` directory of a PyTorch wheel (tools/libtorch_from_wheel.sh
makes one from a pinned PyPI wheel) or an extracted LibTorch archive (cxx11 ABI), holding include/
and lib/. See README, "GPUs and NCCL".

Two targets: `libtorch`, for every process that runs the model, and `libtorch_cuda`, which
//third_party:torch uses under --config=cuda.
"""

# Third-party headers a PyTorch wheel ships in include/ that bertshard takes from Debian (protobuf)
# or never uses; none of LibTorch's own headers include them.
_BUNDLED_HEADERS = ["google", "pybind11", "tensorpipe"]

def _libtorch_impl(ctx):
    root = ctx.os.environ.get("BERTSHARD_LIBTORCH", "")
    if root:
        if not ctx.path(root + "/include/ATen/ATen.h").exists:
            fail("BERTSHARD_LIBTORCH=%s has no include/ATen/ATen.h (expected a LibTorch directory)" % root)
        # The wheel's include/ also holds the headers of libraries LibTorch bundles, protobuf among
        # them (an older one than Debian's, which the gRPC targets use): expose everything but those.
        for entry in ctx.path(root + "/include").readdir():
            if entry.basename not in _BUNDLED_HEADERS:
                ctx.symlink(entry, "include/" + entry.basename)
        lib = root + "/lib"

        # CPU processes link only libtorch_cpu and c10. libtorch.so of a CUDA wheel is a shim that
        # pulls in libtorch_cuda.so, and with it cuBLAS, cuDNN and NCCL, which a CPU run never uses
        # and a CPU machine may not have. `libtorch_cuda` adds them.
        cuda_libs = ["-ltorch", "-ltorch_cuda", "-lc10_cuda"] if ctx.path(lib + "/libtorch_cuda.so").exists else []
        ctx.file("BUILD", """
cc_library(
    name = "libtorch",
    hdrs = glob(["include/**"]),
    includes = ["include", "include/torch/csrc/api/include"],
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-Wl,--push-state,--no-as-needed",
                "-ltorch_cpu", "-lc10", "-Wl,--pop-state", "-lpthread"],
    visibility = ["//visibility:public"],
)

cc_library(
    name = "libtorch_cuda",
    linkopts = ["-Wl,--push-state,--no-as-needed"] + {cuda_libs} + ["-Wl,--pop-state"],
    visibility = ["//visibility:public"],
    deps = [":libtorch"],
)
""".format(lib = lib, cuda_libs = str(cuda_libs)))
    else:
        # Debian: ATen, c10 and c10d headers are in /usr/include (a builtin include directory);
        # only the C++ API root needs adding. It has no CUDA part: the NCCL backend (--config=cuda)
        # links NCCL itself.
        ctx.symlink("/usr/include/torch/csrc/api/include", "api")
        ctx.file("BUILD", """
cc_library(
    name = "libtorch",
    hdrs = glob(["api/**/*.h"]),
    includes = ["api"],
    linkopts = ["-Wl,--push-state,--no-as-needed", "-ltorch", "-ltorch_cpu", "-lc10",
                "-Wl,--pop-state", "-lpthread"],
    visibility = ["//visibility:public"],
)

alias(
    name = "libtorch_cuda",
    actual = ":libtorch",
    visibility = ["//visibility:public"],
)
""")

libtorch_repository = repository_rule(
    implementation = _libtorch_impl,
    environ = ["BERTSHARD_LIBTORCH"],
    local = True,
)
