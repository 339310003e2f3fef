"""Finds CUDA and NCCL (default /usr/local/cuda, or $CUDA_HOME) for the optional --config=cuda build.

Without them the @local_cuda//:cuda target is incompatible, so `bazel build //...` skips the NCCL
code instead of failing on machines without CUDA.
"""

def _local_cuda_impl(ctx):
    root = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = ctx.path(root + "/include/nccl.h").exists and ctx.path(root + "/include/cuda_runtime.h").exists
    if found:
        ctx.symlink(root + "/include", "include")
        lib = root + "/lib64"
        ctx.file("BUILD", """
cc_library(
    name = "cuda",
    hdrs = glob(["include/**"]),
    includes = ["include"],
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lnccl", "-lcudart"],
    visibility = ["//visibility:public"],
)
""".format(lib = lib))
    else:
        ctx.file("BUILD", """
cc_library(
    name = "cuda",
    target_compatible_with = ["@bertshard//third_party:incompatible"],
    visibility = ["//visibility:public"],
)
""")
    ctx.file("defs.bzl", "CUDA_FOUND = %s\n" % found)

local_cuda = repository_rule(
    implementation = _local_cuda_impl,
    environ = ["CUDA_HOME"],
    local = True,
)
