"""Protobuf/gRPC C++ code generation with Debian's /usr/bin/protoc and grpc_cpp_plugin.

A genrule calling protoc by absolute path does not track the compiler: after an apt upgrade of
protobuf, run `bazel clean`.
"""

load("@rules_cc//cc:defs.bzl", "cc_library")

def cc_proto(name, src, grpc = False, imports = [], deps = [], visibility = None):
    """Generates messages (and, with grpc = True, the service) of one .proto in this package.

    `src` is relative to this package and must sit at its import path, e.g. bertshard/v1/plan.proto;
    `imports` are the .proto files of this package that it imports, `deps` their cc_proto targets.
    """
    base = src[:-len(".proto")]
    outs = [base + ".pb.h", base + ".pb.cc"]
    cmd = "/usr/bin/protoc -I{pkg} -I/usr/include -I/usr/share/grpc-proto --cpp_out=$(@D) $(location {src})"
    if grpc:
        outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
        cmd += " && /usr/bin/protoc -I{pkg} -I/usr/include -I/usr/share/grpc-proto --grpc_out=$(@D) --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin $(location {src})"
    native.genrule(
        name = name + "_gen",
        srcs = [src] + imports,
        outs = outs,
        cmd = cmd.format(src = src, pkg = native.package_name()),
    )
    cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        # Descriptors register themselves from static initialisers; a server that references no
        # symbol of a .pb.o (coordinator.pb: just the service) would otherwise drop it, and
        # reflection could not describe the service.
        alwayslink = True,
        deps = deps + ["//third_party:protobuf"] + (["//third_party:grpc"] if grpc else []),
        visibility = visibility,
    )

def cc_system_proto(name, path, grpc = False, headers_only = False, visibility = None):
    """Generates C++ for a .proto that Debian ships under /usr/share/grpc-proto (e.g. health).

    With headers_only, only the headers are produced: for protos whose compiled code a system
    library (libgrpc++_reflection) already contains, so linking it twice would clash.
    """
    base = path[:-len(".proto")]
    outs = [base + ".pb.h"] + ([] if headers_only else [base + ".pb.cc"])
    cmd = "/usr/bin/protoc -I/usr/share/grpc-proto -I/usr/include --cpp_out=$(@D)/gen /usr/share/grpc-proto/" + path
    if grpc:
        outs += [base + ".grpc.pb.h"] + ([] if headers_only else [base + ".grpc.pb.cc"])
        cmd += " && /usr/bin/protoc -I/usr/share/grpc-proto -I/usr/include --grpc_out=$(@D)/gen --plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin /usr/share/grpc-proto/" + path
    if headers_only:
        cmd += " && rm -f $(@D)/gen/" + base + ".pb.cc $(@D)/gen/" + base + ".grpc.pb.cc"
    gen_outs = ["gen/" + o for o in outs]
    native.genrule(
        name = name + "_gen",
        outs = gen_outs,
        cmd = cmd,
    )
    cc_library(
        name = name,
        srcs = [o for o in gen_outs if o.endswith(".cc")],
        hdrs = [o for o in gen_outs if o.endswith(".h")],
        includes = ["gen"],
        alwayslink = True,
        deps = ["//third_party:protobuf"] + (["//third_party:grpc"] if grpc else []),
        visibility = visibility,
    )
