"""LibTorch for the model processes: Debian's CPU build (libtorch-dev) by default, or a CUDA-enabled
LibTorch named by $BERTSHARD_LIBTORCH -- the `torch/` directory of a PyTorch wheel or an extracted
LibTorch archive (cxx11 ABI), holding include/ and lib/. See README, "GPUs and NCCL".
"""

def _libtorch_impl(ctx):
    root = ctx.os.environ.get("BERTSHARD_LIBTORCH", "")
    if root:
        if not ctx.path(root + "/include/ATen/ATen.h").exists:
            fail("BERTSHARD_LIBTORCH=%s has no include/ATen/ATen.h (expected a LibTorch directory)" % root)
        ctx.symlink(root + "/include", "include")
        lib = root + "/lib"
        cuda_libs = ["-ltorch_cuda", "-lc10_cuda"] if ctx.path(lib + "/libtorch_cuda.so").exists else []
        ctx.file("BUILD", """
cc_library(
    name = "libtorch",
    hdrs = glob(["include/**"]),
    includes = ["include", "include/torch/csrc/api/include"],
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-Wl,--push-state,--no-as-needed",
                "-ltorch", "-ltorch_cpu", "-lc10"] + {cuda_libs} + ["-Wl,--pop-state", "-lpthread"],
    visibility = ["//visibility:public"],
)
""".format(lib = lib, cuda_libs = str(cuda_libs)))
    else:
        # Debian: ATen, c10 and c10d headers are in /usr/include (a builtin include directory);
        # only the C++ API root needs adding.
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
""")

libtorch_repository = repository_rule(
    implementation = _libtorch_impl,
    environ = ["BERTSHARD_LIBTORCH"],
    local = True,
)
